"""`CheckpointReader`: a verified, lazily read view of one checkpoint (single file or sharded directory).

Opening checks everything that can be checked without reading tensor data: the index parses, every file it names
exists, each safetensors header is well formed and matches its file size, every tensor the index places in a file is
there, and (for cx-written checkpoints) `total_size` equals the bytes in the shards. Tensors, or rectangular regions
of them, are then read one at a time through safetensors `safe_open`, so a load never holds the whole checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from cx_checkpoint._errors import (
    CheckpointIndexError,
    CheckpointKindError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CorruptShardError,
    MissingShardError,
)
from cx_checkpoint._files import load_bin, read_safetensors_header
from cx_checkpoint._index import CheckpointIndexFile
from cx_checkpoint._naming import CheckpointKind, FileFormat, FileNames, file_names
from cx_checkpoint._protocols import Region, TensorSpec

__all__ = ["CheckpointReader"]

_BIN_SUFFIXES = (".bin", ".pt", ".pth")


def _families(kind: CheckpointKind, prefix: str | None) -> list[FileNames]:
    formats = [FileFormat.SAFETENSORS] if kind is CheckpointKind.OPTIMIZER else [FileFormat.SAFETENSORS, FileFormat.BIN]
    return [file_names(kind, fmt, prefix) for fmt in formats]


class CheckpointReader:
    """Names, full shapes and dtypes of a checkpoint's tensors, and reads of whole tensors or regions."""

    def __init__(
        self,
        path: Path,
        kind: CheckpointKind,
        files: dict[str, Path],
        locations: dict[str, str],
        specs: dict[str, TensorSpec],
        metadata: dict[str, dict[str, str]],
        index_path: Path | None,
        bin_contents: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        self.path = path
        self.kind = kind
        self.index_path = index_path
        self._files = files
        self._locations = locations
        self._specs = specs
        self._metadata = metadata
        self._bin = bin_contents
        self._handles: dict[str, Any] = {}

    # ---- opening -------------------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        checkpoint: str | os.PathLike[str],
        kind: CheckpointKind = CheckpointKind.MODEL,
        prefix: str | None = None,
    ) -> CheckpointReader:
        """Open and verify: a `.safetensors` / `.bin` file, an `*.index.json`, or a checkpoint directory."""
        path = Path(checkpoint)
        if not path.exists():
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
        if path.is_file():
            if path.name.endswith(".index.json"):
                return cls._open_index(path, kind)
            return cls._open_single(path, kind)
        for family in _families(kind, prefix):
            if (path / family.index).is_file():
                return cls._open_index(path / family.index, kind)
        for family in _families(kind, prefix):
            if (path / family.single).is_file():
                return cls._open_single(path / family.single, kind)
        other = CheckpointKind.OPTIMIZER if kind is CheckpointKind.MODEL else CheckpointKind.MODEL
        for family in _families(other, prefix):
            for name in (family.index, family.single):
                if (path / name).is_file():
                    raise CheckpointKindError(
                        f"{path} holds a checkpoint of kind {other.value!r} ({name}), "
                        f"not of kind {kind.value!r} as asked"
                    )
        if prefix is None:
            suffixes = [f"-{family.index}" for family in _families(kind, None)]
            prefixed = sorted(p.name for p in path.iterdir() if any(p.name.endswith(s) for s in suffixes))
            if len(prefixed) == 1:
                return cls._open_index(path / prefixed[0], kind)
            if len(prefixed) > 1:
                raise CheckpointIndexError(f"{path} holds several {kind.value} indexes {prefixed}: pass the index file")
        expected = " or ".join(f"{family.index} / {family.single}" for family in _families(kind, prefix))
        raise CheckpointIndexError(f"{path}: no {kind.value} checkpoint found there (looked for {expected})")

    @classmethod
    def _open_single(cls, path: Path, kind: CheckpointKind) -> CheckpointReader:
        files = {path.name: path}
        if path.suffix == ".safetensors":
            header = read_safetensors_header(path)
            _check_kind(path, header.metadata, kind)
            specs = {name: TensorSpec(shape, dtype) for name, (dtype, shape, _) in header.tensors.items()}
            return cls(
                path, kind, files, dict.fromkeys(specs, path.name), specs, {path.name: header.metadata}, None, {}
            )
        if path.suffix in _BIN_SUFFIXES:
            if kind is CheckpointKind.OPTIMIZER:
                raise CheckpointKindError(
                    f"{path} is a pickle file; cx optimizer checkpoints are safetensors plus JSON (no pickle)"
                )
            content = load_bin(path)
            specs = {name: TensorSpec.of(t) for name, t in content.items()}
            return cls(path, kind, files, dict.fromkeys(specs, path.name), specs, {}, None, {path.name: content})
        raise CheckpointPathError(f"{path}: not a checkpoint file (expected .safetensors, .bin or *.index.json)")

    @classmethod
    def _open_index(cls, index_path: Path, kind: CheckpointKind) -> CheckpointReader:
        index = CheckpointIndexFile.from_file(index_path)
        directory = index_path.parent
        files: dict[str, Path] = {}
        specs: dict[str, TensorSpec] = {}
        metadata: dict[str, dict[str, str]] = {}
        bin_contents: dict[str, dict[str, torch.Tensor]] = {}
        held_bytes = 0
        all_cx = True
        for file_name in index.file_names():
            path = directory / file_name
            wanted = index.tensors_in(file_name)
            if not path.is_file():
                raise MissingShardError(
                    f"{index_path}: shard file {file_name} is missing (it should hold {len(wanted)} tensors, "
                    f"e.g. {wanted[0]!r})"
                )
            files[file_name] = path
            if file_name.endswith(".safetensors"):
                header = read_safetensors_header(path)
                _check_kind(path, header.metadata, kind)
                metadata[file_name] = header.metadata
                all_cx = all_cx and "cx_kind" in header.metadata
                found = {
                    name: (TensorSpec(shape, dtype), nbytes) for name, (dtype, shape, nbytes) in header.tensors.items()
                }
            elif file_name.endswith(_BIN_SUFFIXES):
                if kind is CheckpointKind.OPTIMIZER:
                    raise CheckpointKindError(f"{path} is a pickle file; cx optimizer checkpoints are safetensors only")
                content = load_bin(path)
                bin_contents[file_name] = content
                all_cx = False
                found = {name: (TensorSpec.of(t), t.numel() * t.element_size()) for name, t in content.items()}
            else:
                raise CheckpointIndexError(f"{index_path}: shard {file_name} is neither .safetensors nor .bin")
            absent = [name for name in wanted if name not in found]
            if absent:
                raise CorruptShardError(
                    f"{path}: the index {index_path.name} places {len(absent)} tensor(s) in this file that it does not "
                    f"contain, e.g. {absent[0]!r} (found {len(found)} tensors)"
                )
            extra = sorted(set(found) - set(wanted))
            if extra:
                raise CheckpointIndexError(
                    f"{index_path}: shard {file_name} holds tensor(s) the index does not list, e.g. {extra[0]!r}"
                )
            for name in wanted:
                specs[name], nbytes = found[name]
                held_bytes += nbytes
        if all_cx and index.total_size >= 0 and index.total_size != held_bytes:
            raise CheckpointIndexError(
                f"{index_path}: metadata.total_size is {index.total_size} bytes but the shards hold {held_bytes} bytes"
            )
        return cls(directory, kind, files, dict(index.weight_map), specs, metadata, index_path, bin_contents)

    # ---- reading -------------------------------------------------------------------------------------------------
    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        """Every tensor in the checkpoint: full shape and dtype."""
        return self._specs

    def names(self) -> list[str]:
        """Tensor names grouped by file (reading in this order touches each file once)."""
        return sorted(self._specs, key=lambda name: (self._locations[name], name))

    def file_of(self, name: str) -> Path:
        return self._files[self._locations[self._known(name)]]

    def metadata_of(self, file_name: str) -> dict[str, str]:
        """The safetensors header metadata of one file of this checkpoint (empty for .bin files)."""
        return dict(self._metadata.get(file_name, {}))

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """Tensor `name` (a CPU tensor), or only `region` of it, read from disk."""
        spec = self._specs[self._known(name)]
        if region is not None:
            _check_region(name, region, spec.shape)
        file_name = self._locations[name]
        if file_name in self._bin:
            tensor = self._bin[file_name][name]
            return tensor[region] if region is not None else tensor
        handle = self._handles.get(file_name)
        if handle is None:
            handle = safe_open(str(self._files[file_name]), framework="pt", device="cpu")
            self._handles[file_name] = handle
        if region is None:
            result: torch.Tensor = handle.get_tensor(name)
        else:
            result = handle.get_slice(name)[region]
        return result

    def close(self) -> None:
        self._handles.clear()
        self._bin.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _known(self, name: str) -> str:
        if name not in self._specs:
            raise KeyError(f"{self.path}: no tensor named {name!r} in this checkpoint")
        return name


def _check_kind(path: Path, metadata: Mapping[str, str], kind: CheckpointKind) -> None:
    found = metadata.get("cx_kind", CheckpointKind.MODEL.value)
    if found != kind.value:
        raise CheckpointKindError(
            f"{path} holds {found} state (cx_kind={found!r}), not the {kind.value} state asked for"
        )


def _check_region(name: str, region: Region, shape: tuple[int, ...]) -> None:
    if not isinstance(region, tuple) or len(region) > len(shape) or not all(isinstance(s, slice) for s in region):
        raise ValueError(f"region for {name!r} must be a tuple of at most {len(shape)} slices, got {region!r}")
    for dim, (part, size) in enumerate(zip(region, shape, strict=False)):
        start = 0 if part.start is None else part.start
        stop = size if part.stop is None else part.stop
        if part.step not in (None, 1) or not 0 <= start <= stop <= size:
            raise ValueError(f"region {region!r} of {name!r} is outside dimension {dim} of size {size} (or has a step)")
