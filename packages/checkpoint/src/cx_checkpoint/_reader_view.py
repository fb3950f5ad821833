"""`_CheckpointView`: what a `CheckpointReader` offers once open: names, specs, metadata and side files of one
save, reads of whole tensors or regions, and `verify` against the recorded checksums.

The base of `CheckpointReader` (see `cx_checkpoint._reader`), apart from opening: it only uses the files already
held open, never a path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from cx_checkpoint._checksum import checksum_of
from cx_checkpoint._errors import CheckpointIndexError, ChecksumMismatchError, MissingShardError
from cx_checkpoint._files import DATA_CHECKSUM_KEY, HEADER_CHECKSUM_KEY, header_checksum
from cx_checkpoint._held_files import _mapped_checksum, _OpenFile, _pread_exact, _read_tensor
from cx_checkpoint._naming import CheckpointKind
from cx_checkpoint._protocols import Region, TensorSpec


class _CheckpointView:
    """Names, full shapes and dtypes of a checkpoint's tensors, and reads; `CheckpointReader` is the class to use."""

    def __init__(
        self,
        path: Path,
        kind: CheckpointKind,
        files: dict[str, _OpenFile],
        locations: dict[str, str],
        specs: dict[str, TensorSpec],
        index_path: Path | None,
        bin_contents: dict[str, dict[str, torch.Tensor]],
        side_files: dict[str, bytes],
        checksums: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self.kind = kind
        self.index_path = index_path
        self._files = files
        self._locations = locations
        self._specs = specs
        self._bin = bin_contents
        self._side_files = side_files
        self._checksums = dict(checksums or {})

    # ---- reading -------------------------------------------------------------------------------------------------
    @property
    def specs(self) -> Mapping[str, TensorSpec]:
        """Every tensor in the checkpoint: full shape and dtype."""
        return self._specs

    def names(self) -> list[str]:
        """Tensor names grouped by file (reading in this order touches each file once)."""
        return sorted(self._specs, key=lambda name: (self._locations[name], name))

    def file_of(self, name: str) -> Path:
        return self._files[self._locations[self._known(name)]].path

    def metadata_of(self, file_name: str) -> dict[str, str]:
        """The safetensors header metadata of one file of this checkpoint (empty for .bin files)."""
        opened = self._files.get(file_name)
        return dict(opened.header.metadata) if opened is not None and opened.header is not None else {}

    def side_text(self, file_name: str) -> str | None:
        """A side file read with this save (the optimizer description `optimizer.json`, or a file the index records
        a checksum for), or None if absent."""
        raw = self._side_files.get(file_name)
        return None if raw is None else raw.decode("utf-8", errors="replace")

    def side_file_names(self) -> list[str]:
        """The side files read with this save, sorted."""
        return sorted(self._side_files)

    def side_bytes(self, file_name: str) -> bytes | None:
        """The exact bytes of a side file read with this save, or None if absent."""
        return self._side_files.get(file_name)

    def recorded_checksums(self) -> dict[str, str]:
        """file name -> checksum recorded in the index at save (shards and side files; empty for a single file)."""
        return dict(self._checksums)

    def read(self, name: str, region: Region | None = None) -> torch.Tensor:
        """Tensor `name` (a CPU tensor), or only `region` of it, read from the file held open."""
        spec = self._specs[self._known(name)]
        if region is not None:
            _check_region(name, region, spec.shape)
        file_name = self._locations[name]
        if file_name in self._bin:
            tensor = self._bin[file_name][name]
            return tensor[region] if region is not None else tensor
        opened = self._files.get(file_name)
        if opened is None or opened.header is None:
            raise ValueError(f"{self.path}: this reader is closed")
        return _read_tensor(opened, name, region)

    def verify(self) -> None:
        """Read every file and compare it with the checksum recorded at save time (`ChecksumMismatchError`)."""
        where = self.index_path or self.path
        if self.index_path is not None:
            if not self._checksums:
                raise CheckpointIndexError(
                    f"{where}: no checksums are recorded in this checkpoint (written before cx recorded them, or by "
                    "another tool): it cannot be verified"
                )
            for file_name, opened in sorted(self._files.items()):
                expected = self._checksums.get(file_name)
                if expected is None:
                    raise CheckpointIndexError(f"{where}: no checksum recorded for {file_name}")
                found = _mapped_checksum(opened, 0, os.fstat(opened.fd).st_size, expected)
                if found != expected:
                    raise ChecksumMismatchError(
                        f"{opened.path}: checksum {found} differs from {expected} recorded at save: the file changed "
                        "after it was written (bit rot, a partial copy, or an edit)"
                    )
            self._verify_side_files(where)
            return
        opened = next(iter(self._files.values()))
        header = opened.header
        expected = None if header is None else header.metadata.get(DATA_CHECKSUM_KEY)
        if header is None or expected is None:
            raise CheckpointIndexError(
                f"{where}: no checksum is recorded in this file (a legacy .bin, or written before cx recorded them, "
                "or by another tool): it cannot be verified"
            )
        found = _mapped_checksum(opened, header.data_start, header.data_bytes, expected)
        if found != expected:
            raise ChecksumMismatchError(
                f"{opened.path}: checksum {found} of the tensor data differs from {expected} recorded at save: the "
                "file changed after it was written (bit rot, a partial copy, or an edit)"
            )
        expected = header.metadata.get(HEADER_CHECKSUM_KEY)  # absent in files written before it was recorded
        if expected is not None:
            found_header = header_checksum(_pread_exact(opened.fd, header.data_start - 8, 8))
            if found_header != expected:
                raise ChecksumMismatchError(
                    f"{opened.path}: checksum {found_header} of the header (tensor layout, metadata, optimizer "
                    f"description) differs from {expected} recorded at save: the file changed after it was written"
                )

    def _verify_side_files(self, where: Path) -> None:
        """Side files against the index's checksums: one recorded there must be present and unchanged (indexes
        written before side files had checksums record none: those are parsed by their loaders only)."""
        for file_name, expected in sorted(self._checksums.items()):
            if file_name in self._files:
                continue
            raw = self._side_files.get(file_name)
            if raw is None:
                raise MissingShardError(f"{where}: {file_name}, recorded with a checksum at save, is missing")
            found = checksum_of(raw, expected)
            if found != expected:
                raise ChecksumMismatchError(
                    f"{self.path / file_name}: checksum {found} differs from {expected} recorded at save: the file "
                    "changed after it was written (bit rot, truncation, a partial copy, or an edit)"
                )

    def _known(self, name: str) -> str:
        if name not in self._specs:
            raise KeyError(f"{self.path}: no tensor named {name!r} in this checkpoint")
        return name


def _check_region(name: str, region: Region, shape: tuple[int, ...]) -> None:
    if not isinstance(region, tuple) or len(region) > len(shape) or not all(isinstance(s, slice) for s in region):
        raise ValueError(f"region for {name!r} must be a tuple of at most {len(shape)} slices, got {region!r}")
    for dim, (part, size) in enumerate(zip(region, shape, strict=False)):
        start = 0 if part.start is None else part.start
        stop = size if part.stop is None else part.stop
        if part.step not in (None, 1) or not 0 <= start <= stop <= size:
            raise ValueError(f"region {region!r} of {name!r} is outside dimension {dim} of size {size} (or has a step)")
