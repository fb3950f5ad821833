"""The files of one checkpoint save, held open: `_OpenFile` and the reads from it (whole file, exact byte ranges,
checksums from the memory map, tensors or regions of them), and closing them.

Kept apart from `CheckpointReader` so that every read goes through these few functions on open descriptors, never
through a path (a later save to the same path cannot change what is read).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from cx_checkpoint._checksum import checksum_of, file_checksum
from cx_checkpoint._errors import CorruptShardError
from cx_checkpoint._files import SafetensorsHeader
from cx_checkpoint._protocols import Region


@dataclass
class _OpenFile:
    """One file of the checkpoint, held open."""

    fd: int
    path: Path
    header: SafetensorsHeader | None  # None for .bin files
    mapping: mmap.mmap | None = None
    """Where /proc is missing: a private map of the whole file, read through copies."""
    base: torch.Tensor | None = None
    """The whole file as a uint8 tensor over a private (copy-on-write) memory map of the open file: tensors read
    from it are views, and the map lives as long as any of them (it holds the file's content once deleted)."""

    def map(self) -> torch.Tensor:
        """The file's bytes as a uint8 tensor; views of it are safe to keep (`zero_copy`) where /proc exists."""
        if self.base is None:
            size = os.fstat(self.fd).st_size
            proc = f"/proc/self/fd/{self.fd}"
            if os.path.exists(proc):
                storage = torch.UntypedStorage.from_file(proc, shared=False, nbytes=size)
                self.base = torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, storage))
            else:  # pragma: no cover - no /proc: an mmap the reader owns, so reads must copy out of it
                self.mapping = mmap.mmap(self.fd, 0, access=mmap.ACCESS_COPY)
                self.base = torch.frombuffer(self.mapping, dtype=torch.uint8)
        return self.base

    @property
    def zero_copy(self) -> bool:
        return self.mapping is None


def _mapped_checksum(opened: _OpenFile, offset: int, length: int, expected: str) -> str:
    """The checksum of a byte range of a held file, computed straight from its memory map (no copy)."""
    if length == 0:
        return checksum_of(b"", expected)
    base = opened.map()
    if base.numel() < offset + length:
        return file_checksum(opened.fd, offset, length, expected)  # short file: reported as a mismatch
    region = base[offset : offset + length]
    view = memoryview((ctypes.c_ubyte * length).from_address(region.data_ptr())).cast("B")
    return checksum_of(view, expected)


def _read_all(fd: int) -> bytes:
    size = os.fstat(fd).st_size
    return _pread_exact(fd, size, 0)


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    parts = []
    while size > 0:
        chunk = os.pread(fd, min(size, 1 << 30), offset)
        if not chunk:
            raise CorruptShardError(f"file descriptor {fd}: unexpected end of file at byte {offset}")
        parts.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _read_tensor(opened: _OpenFile, name: str, region: Region | None) -> torch.Tensor:
    """Tensor `name` of a safetensors file held open, or a region of it: a copy of just the bytes spanning it, taken
    from the file's memory map (the page cache, no intermediate buffer)."""
    if sys.byteorder != "little":  # pragma: no cover
        raise NotImplementedError("cx-checkpoint reads safetensors (little-endian) on little-endian machines only")
    header = opened.header
    assert header is not None
    dtype, shape, _ = header.tensors[name]
    begin = header.data_start + header.offsets[name]
    itemsize = dtype.itemsize
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    parts = list(region or ()) + [slice(None)] * (len(shape) - len(region or ()))
    starts, sizes = [], []
    for part, size in zip(parts, shape, strict=True):
        start, stop, _ = part.indices(size)
        starts.append(start)
        sizes.append(max(0, stop - start))
    if any(size == 0 for size in sizes):
        return torch.empty(sizes, dtype=dtype)
    first = sum(s * st for s, st in zip(starts, strides, strict=True))
    last = sum((s + n - 1) * st for s, n, st in zip(starts, sizes, strides, strict=True))
    start = begin + first * itemsize
    raw = opened.map()[start : start + (last - first + 1) * itemsize]
    try:
        values = raw.view(dtype)
    except RuntimeError:  # data not aligned for its dtype (some writers do not align): copy the bytes first
        values = raw.clone().view(dtype)
    result = values.reshape(shape) if region is None else torch.as_strided(values, sizes, strides).contiguous()
    return result if opened.zero_copy else result.clone()


def _close_all(files: Mapping[str, _OpenFile]) -> None:
    for opened in files.values():
        opened.base = None  # tensors read from it keep the map alive as long as they need it
        if opened.mapping is not None:
            with contextlib.suppress(BufferError):  # a view still alive elsewhere: the map goes with it
                opened.mapping.close()
            opened.mapping = None
        if opened.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(opened.fd)
            opened.fd = -1
            opened.header = None
    if isinstance(files, dict):
        files.clear()
