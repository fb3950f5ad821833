"""Checking checkpoints against the checksums recorded when they were saved: `verify_checkpoints(folder)` and the
`cx-checkpoint-verify <folder>` command (also `python -m cx_checkpoint verify <folder>`).

Every checkpoint found under the folder is checked: each sharded one (an `*.index.json`, every shard file read in
full against `metadata.cx_checksums`) and each single `.safetensors` file no index refers to (its data section
against the `cx_data_checksum` header entry). Staging leftovers of interrupted saves are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cx_checkpoint._errors import CheckpointError, CheckpointKindError
from cx_checkpoint._index import CheckpointIndexFile
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
    if folder.is_file():
        return [folder]
    found = [p for p in sorted(folder.rglob("*")) if p.is_file() and not _hidden(p.relative_to(folder))]
    indexes = [p for p in found if p.name.endswith(".index.json")]
    covered: set[Path] = set()
    for index in indexes:
        with contextlib.suppress(CheckpointError):  # a broken index is reported when it is verified itself
            covered.update(index.parent / name for name in CheckpointIndexFile.from_file(index).file_names())
    singles = [p for p in found if p.suffix in (".safetensors", ".bin", ".pt", ".pth") and p not in covered]
    return indexes + singles


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _verify_one(path: Path) -> VerifyResult:
    last: CheckpointError | None = None
    for kind in (CheckpointKind.MODEL, CheckpointKind.OPTIMIZER):
        try:
            with CheckpointReader.open(path, kind) as reader:
                files = 1 if reader.index_path is None else len({reader.file_of(n) for n in reader.specs})
                reader.verify()
            return VerifyResult(path, VerifyOutcome.OK, f"{kind.value}, {files} file(s), {len(reader.specs)} tensors")
        except CheckpointKindError as error:
            last = error
            continue
        except CheckpointError as error:
            unverifiable = "cannot be verified" in str(error)
            outcome = VerifyOutcome.UNVERIFIABLE if unverifiable else VerifyOutcome.FAILED
            return VerifyResult(path, outcome, f"{type(error).__name__}: {error}")
    return VerifyResult(path, VerifyOutcome.FAILED, f"{type(last).__name__}: {last}")


def verify_checkpoints(folder: str | Path) -> list[VerifyResult]:
    """Verify every checkpoint under `folder` (or the single checkpoint file `folder`)."""
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
