"""Checksums of files that are not tensor checkpoints (a trainer's state JSON beside its checkpoints), recorded in a
`cx-checksums.json` manifest in their directory, so `cx-checkpoint-verify` checks them too.

The manifest is `{"format": "cx-checksums/1", "files": {<plain file name>: "crc32:<hex>"}}`. `record_checksums`
adds or updates entries (a caller writing a checkpoint directory records its own files there before committing it);
verifying reads each listed file in full, compares its checksum and, for a `.json` file, parses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from cx_checkpoint._atomic import write_file_atomic
from cx_checkpoint._checksum import checksum_of
from cx_checkpoint._errors import ChecksumMismatchError, CorruptShardError, MissingShardError
from cx_checkpoint._index import is_plain_file_name
from cx_checkpoint._json_codec import parse_json

__all__ = ["CHECKSUMS_FILE", "check_manifest", "manifest_files", "record_checksums"]

CHECKSUMS_FILE = "cx-checksums.json"
_FORMAT = "cx-checksums/1"


def record_checksums(directory: str | os.PathLike[str], names: Iterable[str]) -> None:
    """Record the checksums of the files `names` (plain names in `directory`, already written) in the directory's
    manifest, keeping entries for other files; the manifest is replaced atomically and fsynced."""
    folder = Path(directory)
    manifest = folder / CHECKSUMS_FILE
    files = manifest_files(manifest) if manifest.exists() else {}
    for name in names:
        if not is_plain_file_name(name) or name == CHECKSUMS_FILE:
            raise ValueError(f"record_checksums: {name!r} is not a plain file name in {folder}")
        files[name] = checksum_of((folder / name).read_bytes())
    text = json.dumps({"format": _FORMAT, "files": dict(sorted(files.items()))}, indent=2) + "\n"
    write_file_atomic(manifest, lambda path: path.write_text(text))


def check_manifest(manifest: Path) -> int:
    """Check every file `manifest` lists (present, same checksum, a `.json` one parses); returns their number.

    Raises `MissingShardError`, `ChecksumMismatchError` or `CorruptShardError` naming the file."""
    files = manifest_files(manifest)
    for name, expected in sorted(files.items()):
        path = manifest.parent / name
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise MissingShardError(f"{manifest}: {name}, recorded with a checksum, is missing") from None
        found = checksum_of(raw, expected)
        if found != expected:
            raise ChecksumMismatchError(
                f"{path}: checksum {found} differs from {expected} recorded in {CHECKSUMS_FILE}: the file changed "
                "after it was written (bit rot, truncation, a partial copy, or an edit)"
            )
        if name.endswith(".json"):
            parse_json(raw, str(path), CorruptShardError, "JSON")
    return len(files)


def manifest_files(manifest: Path) -> dict[str, str]:
    """file name -> recorded checksum (`CorruptShardError` when the manifest is not a well-formed one)."""
    data = parse_json(manifest.read_bytes(), str(manifest), CorruptShardError, "checksum manifest")
    files = data.get("files") if isinstance(data, dict) and data.get("format") == _FORMAT else None
    if not isinstance(files, dict) or not all(
        isinstance(k, str) and is_plain_file_name(k) and isinstance(v, str) for k, v in files.items()
    ):
        raise CorruptShardError(f"{manifest}: not a {_FORMAT} manifest (a 'files' object of name -> checksum)")
    return dict(files)
