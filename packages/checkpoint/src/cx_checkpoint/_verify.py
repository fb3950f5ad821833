"""Checking checkpoints against the checksums recorded when they were saved: `verify_checkpoints(folder)` and the
`cx-checkpoint-verify <folder>` command (also `python -m cx_checkpoint verify <folder>`).

Everything a load would read under the folder is checked: each sharded checkpoint (an `*.index.json`: every shard
and side file such as `optimizer.json` or `config.json` read in full against `metadata.cx_checksums`), each
`cx-checksums.json` manifest (the files it lists, e.g. cx-train's `trainer.json`), and each single tensor file no
index or manifest refers to, whatever its name (told by its first bytes, as the loader does: its data section and
header against the `cx_data_checksum` / `cx_header_checksum` entries). Every JSON a load parses is parsed too (the
optimizer description, side files, manifest-listed `.json` files), and so is every other `.json` in the folder (an
LR scheduler's state, a `trainer.json` of a checkpoint without a manifest, tokenizer files): with no checksum to
check, a truncated or garbled one is still caught. Staging leftovers of interrupted saves are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cx_checkpoint._errors import CheckpointError, CheckpointKindError, CorruptShardError
from cx_checkpoint._files import sniff_format
from cx_checkpoint._general import read_optimizer_meta
from cx_checkpoint._index import CheckpointIndexFile
from cx_checkpoint._json_codec import parse_json
from cx_checkpoint._manifest import CHECKSUMS_FILE, check_manifest, manifest_files
from cx_checkpoint._naming import CheckpointKind
from cx_checkpoint._reader import CheckpointReader

__all__ = ["VerifyOutcome", "VerifyResult", "main", "verify_checkpoints"]


class VerifyOutcome(enum.Enum):
    OK = "ok"
    FAILED = "failed"
    UNVERIFIABLE = "unverifiable"
    """No checksum recorded (a legacy `.bin`, a file from another tool or from before cx recorded checksums)."""


@dataclass(frozen=True)
class VerifyResult:
    path: Path
    outcome: VerifyOutcome
    detail: str


def _candidates(folder: Path) -> list[Path]:
    """Every index, checksum manifest, and tensor file no index or manifest refers to (told by suffix or, for any
    other name, by its first bytes, as the loader tells them)."""
    if folder.is_file():
        return [folder]
    found = [p for p in sorted(folder.rglob("*")) if p.is_file() and not _hidden(p.relative_to(folder))]
    indexes = [p for p in found if p.name.endswith(".index.json")]
    manifests = [p for p in found if p.name == CHECKSUMS_FILE]
    covered: set[Path] = set()
    for index in indexes:
        with contextlib.suppress(CheckpointError):  # a broken index is reported when it is verified itself
            parsed = CheckpointIndexFile.from_file(index)
            covered.update(index.parent / name for name in [*parsed.file_names(), *parsed.checksums])
    for manifest in manifests:
        with contextlib.suppress(CheckpointError, OSError):  # reported when the manifest is checked itself
            covered.update(manifest.parent / name for name in manifest_files(manifest))
    for index in indexes:  # an optimizer index's description is parsed with its checkpoint
        covered.add(index.parent / (index.name.removesuffix(".safetensors.index.json") + ".json"))
    rest = [p for p in found if p not in covered and p not in indexes and p not in manifests]
    singles = [p for p in rest if _tensor_file(p)]
    other_json = [p for p in rest if p.suffix == ".json"]
    return indexes + manifests + singles + other_json


def _tensor_file(path: Path) -> bool:
    if path.suffix in (".safetensors", ".bin", ".pt", ".pth"):
        return True
    if path.suffix == ".json":
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return sniff_format(fd) is not None
    finally:
        os.close(fd)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _verify_one(path: Path) -> VerifyResult:
    if path.name == CHECKSUMS_FILE:
        return _verify_manifest(path)
    if path.suffix == ".json" and not path.name.endswith(".index.json"):
        return _verify_json(path)
    last: CheckpointError | None = None
    for kind in (CheckpointKind.MODEL, CheckpointKind.OPTIMIZER):
        try:
            with CheckpointReader.open(path, kind) as reader:
                return _verify_reader(path, kind, reader)
        except CheckpointKindError as error:
            last = error
            continue
        except CheckpointError as error:
            return VerifyResult(path, VerifyOutcome.FAILED, f"{type(error).__name__}: {error}")
    return VerifyResult(path, VerifyOutcome.FAILED, f"{type(last).__name__}: {last}")


def _verify_reader(path: Path, kind: CheckpointKind, reader: CheckpointReader) -> VerifyResult:
    """Checksums first (tensor files, header, side files), then every JSON the load reads is parsed: the optimizer
    description (`optimizer.json` or the single file's header entry) and each side file recorded in the index."""
    files = 1 if reader.index_path is None else len({reader.file_of(n) for n in reader.specs})
    unverifiable: CheckpointError | None = None
    try:
        reader.verify()
    except CheckpointError as error:
        if "cannot be verified" not in str(error):
            raise
        unverifiable = error
    notes = []
    if kind is CheckpointKind.OPTIMIZER:
        read_optimizer_meta(reader)
        if reader.index_path is not None:
            description = reader.index_path.name.removesuffix(".safetensors.index.json") + ".json"
            if unverifiable is None and description not in reader.recorded_checksums():
                notes.append(f"{description} has no checksum recorded (saved before they were): parsed only")
    for name in reader.side_file_names():
        if name.endswith(".json"):
            parse_json(reader.side_bytes(name) or b"", str(reader.path / name), CorruptShardError, "JSON")
    if unverifiable is not None:
        return VerifyResult(path, VerifyOutcome.UNVERIFIABLE, f"{type(unverifiable).__name__}: {unverifiable}")
    detail = f"{kind.value}, {files} file(s), {len(reader.specs)} tensors"
    side = reader.side_file_names()
    if side:
        detail += f", side file(s) {', '.join(side)}"
    return VerifyResult(path, VerifyOutcome.OK, "; ".join([detail, *notes]))


def _verify_json(path: Path) -> VerifyResult:
    """A JSON file no index or manifest records a checksum for: it must at least parse (OK means parsed only)."""
    try:
        parse_json(path.read_bytes(), str(path), CorruptShardError, "JSON")
    except (CheckpointError, OSError) as error:
        return VerifyResult(path, VerifyOutcome.FAILED, f"{type(error).__name__}: {error}")
    return VerifyResult(path, VerifyOutcome.OK, "JSON with no checksum recorded: parsed only")


def _verify_manifest(path: Path) -> VerifyResult:
    try:
        count = check_manifest(path)
    except CheckpointError as error:
        return VerifyResult(path, VerifyOutcome.FAILED, f"{type(error).__name__}: {error}")
    return VerifyResult(path, VerifyOutcome.OK, f"{count} file(s) recorded in {CHECKSUMS_FILE}")


def verify_checkpoints(folder: str | Path) -> list[VerifyResult]:
    """Verify every checkpoint under `folder` (or the single checkpoint file `folder`): one result per sharded
    checkpoint (its index), checksum manifest and single tensor file found (see the module docstring)."""
    root = Path(folder)
    if not root.exists():
        return [VerifyResult(root, VerifyOutcome.FAILED, "does not exist")]
    return [_verify_one(path) for path in _candidates(root)]


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 every checkpoint verified, 1 any failure (or nothing found), 2 some had no checksums."""
    parser = argparse.ArgumentParser(
        prog="cx-checkpoint-verify",
        description="Check every cx checkpoint under FOLDER against the checksums recorded when it was saved.",
    )
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    results = verify_checkpoints(args.folder)
    for result in results:
        print(f"{result.outcome.value.upper():13} {result.path}: {result.detail}")
    if not results:
        print(f"FAILED        {args.folder}: no checkpoint found", file=sys.stderr)
        return 1
    if any(r.outcome is VerifyOutcome.FAILED for r in results):
        return 1
    return 2 if any(r.outcome is VerifyOutcome.UNVERIFIABLE for r in results) else 0
