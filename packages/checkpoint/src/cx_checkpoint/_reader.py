"""`CheckpointReader`: a verified, lazily read view of ONE save of a checkpoint (single file or sharded directory).

Opening checks everything that can be checked without reading tensor data: the index parses, every file it names
exists, each safetensors header is well formed and matches its file size, every tensor the index places in a file is
there, and (for cx-written checkpoints) `total_size` equals the bytes in the shards. With `verify=True` it also
reads every file once and compares it with the checksum recorded at save time.

Every file is opened at open time, relative to one open handle of the checkpoint directory, and all later reads go
through those open files: a save committed to the same path while the reader is open (a new directory swapped
in, the old one deleted) cannot change what the reader sees, so a load always sees exactly one save. Symbolic links
inside the checkpoint directory that lead outside it are refused. Tensors, or rectangular regions of them, are read
one at a time (copied from a memory map of the open file, just the bytes needed), so a load never holds the whole
checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap
import os
import stat
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch

from cx_checkpoint._checksum import checksum_of, file_checksum
from cx_checkpoint._errors import (
    CheckpointError,
    CheckpointIndexError,
    CheckpointKindError,
    CheckpointNotFoundError,
    CheckpointPathError,
    ChecksumMismatchError,
    CorruptShardError,
    MissingShardError,
)
from cx_checkpoint._files import (
    DATA_CHECKSUM_KEY,
    HEADER_CHECKSUM_KEY,
    SafetensorsHeader,
    header_checksum,
    load_bin,
    read_safetensors_header,
    sniff_format,
)
from cx_checkpoint._index import CheckpointIndexFile, is_plain_file_name
from cx_checkpoint._naming import CheckpointKind, FileFormat, FileNames, file_names
from cx_checkpoint._protocols import Region, TensorSpec

__all__ = ["VERIFY_BY_DEFAULT", "CheckpointReader"]

_BIN_SUFFIXES = (".bin", ".pt", ".pth")
_OPEN_ATTEMPTS = 50

VERIFY_BY_DEFAULT: ContextVar[bool] = ContextVar("cx_checkpoint_verify", default=False)
"""What `CheckpointReader.open(verify=None)` does; `CheckpointIO.load_*(verify=True)` sets it around a load, so
plugins' own readers verify too."""


def _families(kind: CheckpointKind, prefix: str | None) -> list[FileNames]:
    formats = [FileFormat.SAFETENSORS] if kind is CheckpointKind.OPTIMIZER else [FileFormat.SAFETENSORS, FileFormat.BIN]
    return [file_names(kind, fmt, prefix) for fmt in formats]


class _Replaced(Exception):
    """The directory being opened was replaced by a newer save while opening it: open again."""


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


class CheckpointReader:
    """Names, full shapes and dtypes of a checkpoint's tensors, and reads of whole tensors or regions."""

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

    # ---- opening -------------------------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        checkpoint: str | os.PathLike[str],
        kind: CheckpointKind = CheckpointKind.MODEL,
        prefix: str | None = None,
        verify: bool | None = None,
    ) -> CheckpointReader:
        """Open and check: a single safetensors or legacy bin file (any name: told by content), an `*.index.json`,
        or a checkpoint directory.

        `verify=True` also compares every file with its recorded checksum (`ChecksumMismatchError` on a difference;
        `CheckpointIndexError` when the checkpoint has none recorded); None takes `VERIFY_BY_DEFAULT`.
        """
        path = Path(checkpoint)
        check = VERIFY_BY_DEFAULT.get() if verify is None else verify
        for _ in range(_OPEN_ATTEMPTS):
            try:
                reader = cls._open_once(path, kind, prefix or None)  # "" is no prefix, as in ColossalAI
            except _Replaced:
                continue
            try:
                if check:
                    reader.verify()
            except BaseException:
                reader.close()
                raise
            return reader
        raise CheckpointError(f"{path}: it was replaced by new saves {_OPEN_ATTEMPTS} times while opening it")

    @classmethod
    def _open_once(cls, path: Path, kind: CheckpointKind, prefix: str | None) -> CheckpointReader:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"checkpoint {path} does not exist") from None
        if not stat.S_ISDIR(info.st_mode):
            if path.name.endswith(".index.json"):
                directory = _open_directory(path.parent)
                try:
                    return cls._open_index(path.parent, directory, path.name, kind)
                finally:
                    os.close(directory)
            return cls._open_single(path, kind)
        directory = _open_directory(path)
        try:
            names = set(os.listdir(directory))
            for family in _families(kind, prefix):
                if family.index in names:
                    return cls._open_index(path, directory, family.index, kind)
            for family in _families(kind, prefix):
                if family.single in names:
                    return cls._open_single(path / family.single, kind)
            other = CheckpointKind.OPTIMIZER if kind is CheckpointKind.MODEL else CheckpointKind.MODEL
            for family in _families(other, prefix):
                for name in (family.index, family.single):
                    if name in names:
                        raise CheckpointKindError(
                            f"{path} holds a checkpoint of kind {other.value!r} ({name}), "
                            f"not of kind {kind.value!r} as asked"
                        )
            if prefix is None:
                suffixes = [f"-{family.index}" for family in _families(kind, None)]
                prefixed = sorted(n for n in names if any(n.endswith(s) for s in suffixes))
                if len(prefixed) == 1:
                    return cls._open_index(path, directory, prefixed[0], kind)
                if len(prefixed) > 1:
                    raise CheckpointIndexError(
                        f"{path} holds several {kind.value} indexes {prefixed}: pass the index file"
                    )
            expected = " or ".join(f"{family.index} / {family.single}" for family in _families(kind, prefix))
            raise CheckpointIndexError(f"{path}: no {kind.value} checkpoint found there (looked for {expected})")
        finally:
            os.close(directory)

    @classmethod
    def _open_single(cls, path: Path, kind: CheckpointKind) -> CheckpointReader:
        """One file of any name: its format is told by its content (`sniff_format`), the suffix only decides for
        content that looks like neither format (so the loaders name what is wrong with it)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise _Replaced() from None  # a directory entry seen a moment ago is gone: a save replaced it
        opened = _OpenFile(fd, path, None)
        try:
            file_format = _single_file_format(path, fd, kind)
            if file_format is FileFormat.SAFETENSORS:
                opened.header = read_safetensors_header(path, fd)
                _check_kind(path, opened.header.metadata, kind)
                specs = {name: TensorSpec(shape, dtype) for name, (dtype, shape, _) in opened.header.tensors.items()}
                locations = dict.fromkeys(specs, path.name)
                return cls(path, kind, {path.name: opened}, locations, specs, None, {}, {})
            content = load_bin(path, fd)
            specs = {name: TensorSpec.of(t) for name, t in content.items()}
            locations = dict.fromkeys(specs, path.name)
            return cls(path, kind, {path.name: opened}, locations, specs, None, {path.name: content}, {})
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _open_index(
        cls, directory_path: Path, directory: int, index_name: str, kind: CheckpointKind
    ) -> CheckpointReader:
        opened: dict[str, _OpenFile] = {}
        try:
            index_path = directory_path / index_name
            index_fd = _open_inside(directory_path, directory, index_name, index_path)
            if index_fd is None:
                raise CheckpointNotFoundError(f"index file {index_path} does not exist")
            try:
                index = CheckpointIndexFile.from_bytes(_read_all(index_fd), str(index_path))
            finally:
                os.close(index_fd)
            specs: dict[str, TensorSpec] = {}
            bin_contents: dict[str, dict[str, torch.Tensor]] = {}
            held_bytes = 0
            all_cx = True
            for file_name in index.file_names():
                path = directory_path / file_name
                wanted = index.tensors_in(file_name)
                fd = _open_inside(directory_path, directory, file_name, index_path)
                if fd is None:
                    raise MissingShardError(
                        f"{index_path}: shard file {file_name} is missing (it should hold {len(wanted)} tensors, "
                        f"e.g. {wanted[0]!r})"
                    )
                opened[file_name] = _OpenFile(fd, path, None)
                if file_name.endswith(".safetensors"):
                    header = read_safetensors_header(path, fd)
                    opened[file_name].header = header
                    _check_kind(path, header.metadata, kind)
                    all_cx = all_cx and "cx_kind" in header.metadata
                    found = {
                        name: (TensorSpec(shape, dtype), nbytes)
                        for name, (dtype, shape, nbytes) in header.tensors.items()
                    }
                elif file_name.endswith(_BIN_SUFFIXES):
                    if kind is CheckpointKind.OPTIMIZER:
                        raise CheckpointKindError(
                            f"{path} is a pickle file; cx optimizer checkpoints are safetensors only"
                        )
                    content = load_bin(path, fd)
                    bin_contents[file_name] = content
                    all_cx = False
                    found = {name: (TensorSpec.of(t), t.numel() * t.element_size()) for name, t in content.items()}
                else:
                    raise CheckpointIndexError(f"{index_path}: shard {file_name} is neither .safetensors nor .bin")
                absent = [name for name in wanted if name not in found]
                if absent:
                    raise CorruptShardError(
                        f"{path}: the index {index_name} places {len(absent)} tensor(s) in this file that it does "
                        f"not contain, e.g. {absent[0]!r} (found {len(found)} tensors)"
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
                    f"{index_path}: metadata.total_size is {index.total_size} bytes but the shards hold "
                    f"{held_bytes} bytes"
                )
            side_files = cls._side_files_of(directory_path, directory, index_name, index, kind)
            if kind is CheckpointKind.OPTIMIZER and not side_files and _replaced(directory_path, directory):
                # the description was deleted with the old save between opening the shards and reading it
                raise _Replaced()
            return cls(
                directory_path,
                kind,
                opened,
                dict(index.weight_map),
                specs,
                index_path,
                bin_contents,
                side_files,
                index.checksums,
            )
        except (MissingShardError, CheckpointNotFoundError):
            _close_all(opened)
            if _replaced(directory_path, directory):
                raise _Replaced() from None
            raise
        except BaseException:
            _close_all(opened)
            raise

    @staticmethod
    def _side_files_of(
        directory_path: Path, directory: int, index_name: str, index: CheckpointIndexFile, kind: CheckpointKind
    ) -> dict[str, bytes]:
        """Side files that belong to this save, read with it from the same directory handle: the optimizer
        description, and every other file the index records a checksum for (`config.json`, ...), so that `verify`
        checks exactly the bytes of this save. An absent one is left out here (`verify` reports it as missing)."""
        names = set(index.checksums) - set(index.file_names())
        if kind is CheckpointKind.OPTIMIZER:
            names.add(index_name.removesuffix(".safetensors.index.json") + ".json")
        found: dict[str, bytes] = {}
        for name in sorted(names):
            if not is_plain_file_name(name):
                raise CheckpointIndexError(
                    f"{directory_path / index_name}: checksum recorded for {name!r}, which is not a plain file name "
                    "in the checkpoint directory"
                )
            fd = _open_inside(directory_path, directory, name, directory_path / index_name)
            if fd is None:
                continue
            try:
                found[name] = _read_all(fd)
            finally:
                os.close(fd)
        return found

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

    def close(self) -> None:
        _close_all(self._files)
        self._bin.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _known(self, name: str) -> str:
        if name not in self._specs:
            raise KeyError(f"{self.path}: no tensor named {name!r} in this checkpoint")
        return name


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


def _open_directory(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except FileNotFoundError:
        raise _Replaced() from None
    except NotADirectoryError:
        raise CheckpointPathError(f"{path} is not a directory") from None


def _replaced(path: Path, directory: int) -> bool:
    """Whether `path` now names another directory than the one held open (a newer save was committed)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return True
    held = os.fstat(directory)
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def _open_inside(directory_path: Path, directory: int, name: str, where: Path) -> int | None:
    """Open `name` relative to the held directory; None when absent. A symlink leading outside is refused."""
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        root = os.path.realpath(directory_path)
        target = os.path.realpath(directory_path / name)
        if os.path.commonpath([root, target]) != root:
            raise CheckpointPathError(
                f"{where}: {name} is a symbolic link to {target}, outside the checkpoint directory {root}: refused "
                "(a checkpoint's files must live inside it)"
            )
    try:
        fd = os.open(name, os.O_RDONLY, dir_fd=directory)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointPathError(f"{where}: {name} is not a regular file")
    return fd


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
