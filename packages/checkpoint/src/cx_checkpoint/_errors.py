"""The `CheckpointError` family: every problem found while saving or loading names what it concerns.

Each subclass is one kind of problem so callers can react to it (e.g. retry from an older checkpoint on a corrupt
shard); messages name the file, the tensor, what was expected and what was found.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CheckpointError",
    "CheckpointIndexError",
    "CheckpointKindError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "CheckpointSaveError",
    "ChecksumMismatchError",
    "CorruptShardError",
    "KeyMismatchError",
    "MissingShardError",
    "TensorMismatchError",
    "UnsafeCheckpointError",
]

_SHOWN_KEYS = 10


class CheckpointError(Exception):
    """Base class of everything cx-checkpoint raises about a checkpoint's content or location."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist."""


class CheckpointPathError(CheckpointError, ValueError):
    """The path exists but is the wrong kind of thing (a file where a directory is needed, or the reverse)."""


class CheckpointIndexError(CheckpointError):
    """The index file is missing, does not parse, or disagrees with the shard files."""


class MissingShardError(CheckpointError):
    """A shard file named by the index does not exist."""


class CorruptShardError(CheckpointError):
    """A shard file is truncated, has a malformed header, or lacks tensors the index places in it."""


class ChecksumMismatchError(CorruptShardError):
    """A file's content differs from the checksum recorded when it was saved (bit rot, partial copy, edit)."""


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; raised with the same message on every rank of a collective save."""


class TensorMismatchError(CheckpointError):
    """A tensor's shape or dtype in the checkpoint differs from what the model (or optimizer) holds."""


class CheckpointKindError(CheckpointError):
    """The checkpoint holds another kind of state than asked for (e.g. an optimizer where a model is expected)."""


class UnsafeCheckpointError(CheckpointError):
    """A legacy pickle file needs arbitrary code to load; it is refused."""


class KeyMismatchError(CheckpointError):
    """Names differ between checkpoint and model/optimizer: missing or unexpected keys (or param groups)."""

    def __init__(self, where: str, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        parts = [where]
        if self.missing:
            parts.append(f"missing from the checkpoint ({len(self.missing)}): {_shorten(self.missing)}")
        if self.unexpected:
            parts.append(f"unexpected in the checkpoint ({len(self.unexpected)}): {_shorten(self.unexpected)}")
        super().__init__("; ".join(parts))


def _shorten(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN_KEYS])
    return shown + (f", ... ({len(names) - _SHOWN_KEYS} more)" if len(names) > _SHOWN_KEYS else "")
