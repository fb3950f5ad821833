"""File names of the cx layout, identical to Hugging Face's: `model-00001-of-00003.safetensors` and friends.

A checkpoint kind (model or optimizer) and a file format (safetensors or legacy bin) give a stem and an extension;
an optional prefix is prepended as `<prefix>-<stem>` (an empty prefix is no prefix, as in ColossalAI's `add_prefix`,
so `prefix=""` and `prefix=None` name the same files). Unsharded files are `<stem><ext>`, shards
`<stem>-<i:05d>-of-<n:05d><ext>`, the index `<stem><ext>.index.json`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "CheckpointKind",
    "FileFormat",
    "FileNames",
    "file_names",
]


class CheckpointKind(Enum):
    """What a checkpoint holds; written into every safetensors header as `cx_kind`."""

    MODEL = "model"
    OPTIMIZER = "optimizer"


class FileFormat(Enum):
    """How tensors are stored: safetensors (the cx format) or the legacy pickle-based `.bin` (models only)."""

    SAFETENSORS = "safetensors"
    BIN = "bin"


_STEMS = {
    (CheckpointKind.MODEL, FileFormat.SAFETENSORS): ("model", ".safetensors"),
    (CheckpointKind.MODEL, FileFormat.BIN): ("pytorch_model", ".bin"),
    (CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS): ("optimizer", ".safetensors"),
}


@dataclass(frozen=True)
class FileNames:
    """The names one (kind, format, prefix) uses inside a checkpoint directory."""

    stem: str
    extension: str

    @property
    def single(self) -> str:
        """The unsharded file: `model.safetensors`, `pytorch_model.bin`."""
        return f"{self.stem}{self.extension}"

    @property
    def index(self) -> str:
        """The index: `model.safetensors.index.json`."""
        return f"{self.stem}{self.extension}.index.json"

    @property
    def optimizer_json(self) -> str:
        """The optimizer's JSON side file (param groups and non-tensor state): `optimizer.json`."""
        return f"{self.stem}.json"

    def shard(self, number: int, total: int) -> str:
        """Shard `number` (1-based) of `total`: `model-00001-of-00003.safetensors`."""
        if not 1 <= number <= total:
            raise ValueError(f"shard number {number} is outside 1..{total}")
        return f"{self.stem}-{number:05d}-of-{total:05d}{self.extension}"

    def owns(self, file_name: str) -> bool:
        """Whether `file_name` is one of this family's files (single, shard or index)."""
        if file_name in (self.single, self.index):
            return True
        pattern = re.escape(self.stem) + r"-\d{5}-of-\d{5}" + re.escape(self.extension)
        return re.fullmatch(pattern, file_name) is not None


def file_names(kind: CheckpointKind, file_format: FileFormat, prefix: str | None = None) -> FileNames:
    """The file names for `kind` stored as `file_format`, optionally prefixed (`<prefix>-model-...`; "" is none)."""
    try:
        stem, extension = _STEMS[(kind, file_format)]
    except KeyError:
        raise ValueError(
            f"{kind.value} checkpoints cannot be stored as {file_format.value}: cx optimizer state is safetensors "
            "plus JSON only (no pickle)"
        ) from None
    if prefix:
        if "/" in prefix or prefix.startswith("."):
            raise ValueError(f"prefix must be a plain file-name prefix (no '/', no leading '.'), got {prefix!r}")
        stem = f"{prefix}-{stem}"
    return FileNames(stem, extension)
