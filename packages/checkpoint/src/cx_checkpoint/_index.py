"""`CheckpointIndexFile`: the Hugging Face shard index, `{"metadata": {"total_size": N}, "weight_map": {...}}`.

Written exactly as `transformers` writes `model.safetensors.index.json` (2-space indent, sorted keys, trailing
newline); `total_size` is the sum of the tensors' byte sizes. Reading validates the structure and refuses file
names that would escape the checkpoint directory. cx adds `metadata.cx_checksums` (file name -> checksum), which
other readers ignore.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cx_checkpoint._errors import CheckpointIndexError, CheckpointNotFoundError
from cx_checkpoint._json_codec import parse_json

__all__ = ["CheckpointIndexFile", "is_plain_file_name"]

_CHECKSUMS = "cx_checksums"


@dataclass
class CheckpointIndexFile:
    """Which shard file holds each tensor, and the total byte size of all tensors (-1: absent from a file read)."""

    weight_map: dict[str, str] = field(default_factory=dict)
    total_size: int = 0
    checksums: dict[str, str] = field(default_factory=dict)
    """shard file name -> its checksum (`"crc32:<hex>"`), stored as `metadata.cx_checksums`; empty when unknown."""

    def add(self, tensor_name: str, file_name: str, nbytes: int) -> None:
        """Record that `tensor_name` (of `nbytes` bytes) lives in `file_name`; a name may appear once."""
        if tensor_name in self.weight_map:
            raise ValueError(
                f"tensor {tensor_name!r} is written twice (in {self.weight_map[tensor_name]} and {file_name})"
            )
        self.weight_map[tensor_name] = file_name
        self.total_size += nbytes

    def file_names(self) -> list[str]:
        """The distinct shard files, sorted."""
        return sorted(set(self.weight_map.values()))

    def tensors_in(self, file_name: str) -> list[str]:
        """The tensor names the index places in `file_name`, sorted."""
        return sorted(name for name, where in self.weight_map.items() if where == file_name)

    def to_json(self) -> str:
        metadata: dict[str, object] = {"total_size": self.total_size}
        if self.checksums:
            metadata[_CHECKSUMS] = self.checksums
        return json.dumps({"metadata": metadata, "weight_map": self.weight_map}, indent=2, sort_keys=True) + "\n"

    def write(self, path: Path) -> None:
        """Write the index to `path` (callers make it durable and atomic)."""
        path.write_text(self.to_json())

    @classmethod
    def merge(cls, parts: Iterable[CheckpointIndexFile]) -> CheckpointIndexFile:
        """One index from several ranks' indexes; a tensor named by two of them is an error."""
        merged = cls()
        for part in parts:
            for name, file_name in part.weight_map.items():
                if name in merged.weight_map:
                    raise ValueError(
                        f"tensor {name!r} is written by two writers (files {merged.weight_map[name]} and {file_name})"
                    )
                merged.weight_map[name] = file_name
            merged.total_size += part.total_size
            merged.checksums.update(part.checksums)
        return merged

    @classmethod
    def from_file(cls, path: str | Path) -> CheckpointIndexFile:
        """Read and validate an index file."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointNotFoundError(f"index file {path} does not exist")
        return cls.from_bytes(path.read_bytes(), str(path))

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> CheckpointIndexFile:
        """Parse and validate an index file's content (`where` names it in errors)."""
        return cls.from_mapping(parse_json(raw, f"index file {where}", CheckpointIndexError, "the index JSON"), where)

    @classmethod
    def from_mapping(cls, data: object, where: str) -> CheckpointIndexFile:
        """Validate a parsed index (`where` names it in errors)."""
        if not isinstance(data, Mapping) or not isinstance(data.get("weight_map"), Mapping):
            raise CheckpointIndexError(f"index {where} has no 'weight_map' object")
        metadata = data.get("metadata", {})
        if not isinstance(metadata, Mapping):
            raise CheckpointIndexError(f"index {where}: 'metadata' must be an object, found {type(metadata).__name__}")
        total = metadata.get("total_size")
        if total is not None and (
            isinstance(total, bool) or not isinstance(total, int | float) or not 0 <= total < math.inf
        ):
            raise CheckpointIndexError(
                f"index {where}: metadata.total_size must be a finite non-negative number, found {total!r}"
            )
        weight_map: dict[str, str] = {}
        for name, file_name in data["weight_map"].items():
            if not isinstance(file_name, str) or not is_plain_file_name(file_name):
                raise CheckpointIndexError(
                    f"index {where}: tensor {name!r} maps to {file_name!r}, which is not a plain file name in the "
                    "checkpoint directory"
                )
            weight_map[str(name)] = file_name
        checksums = metadata.get(_CHECKSUMS, {})
        if not isinstance(checksums, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
        ):
            raise CheckpointIndexError(f"index {where}: metadata.{_CHECKSUMS} must map file names to strings")
        return cls(weight_map, int(total) if total is not None else -1, dict(checksums))


def is_plain_file_name(name: str) -> bool:
    """A file name directly inside the checkpoint directory (no separator, not `.` or `..`)."""
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")
