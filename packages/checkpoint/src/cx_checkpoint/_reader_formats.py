"""Which files a checkpoint of a kind is looked for under, and which format and kind a file holds: checked while
opening, before any tensor is read.

Kept apart from `CheckpointReader`'s opening so the rules (file name families, `cx_kind` metadata, content sniffing
before the suffix, no pickle for optimizer state) read in one place.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from cx_checkpoint._errors import CheckpointKindError, CheckpointPathError
from cx_checkpoint._files import sniff_format
from cx_checkpoint._naming import CheckpointKind, FileFormat, FileNames, file_names

_BIN_SUFFIXES = (".bin", ".pt", ".pth")


def _families(kind: CheckpointKind, prefix: str | None) -> list[FileNames]:
    formats = [FileFormat.SAFETENSORS] if kind is CheckpointKind.OPTIMIZER else [FileFormat.SAFETENSORS, FileFormat.BIN]
    return [file_names(kind, fmt, prefix) for fmt in formats]


def _check_kind(path: Path, metadata: Mapping[str, str], kind: CheckpointKind) -> None:
    found = metadata.get("cx_kind", CheckpointKind.MODEL.value)
    if found != kind.value:
        raise CheckpointKindError(
            f"{path} holds {found} state (cx_kind={found!r}), not the {kind.value} state asked for"
        )


def _single_file_format(path: Path, fd: int, kind: CheckpointKind) -> FileFormat:
    """How to read the single checkpoint file `path` (open as `fd`): by content first, then by suffix.

    Optimizer checkpoints are always safetensors plus JSON: a pickle is refused before anything is read from it."""
    sniffed = sniff_format(fd)
    if kind is CheckpointKind.OPTIMIZER:
        if sniffed is FileFormat.BIN:
            raise CheckpointKindError(
                f"{path} is a pickle file; cx optimizer checkpoints are safetensors plus JSON (no pickle)"
            )
        return FileFormat.SAFETENSORS
    if sniffed is not None:
        return sniffed
    if path.suffix == ".safetensors":
        return FileFormat.SAFETENSORS
    if path.suffix in _BIN_SUFFIXES:
        return FileFormat.BIN
    raise CheckpointPathError(
        f"{path}: not a checkpoint file (its first bytes are neither a safetensors header nor a torch.save file)"
    )
