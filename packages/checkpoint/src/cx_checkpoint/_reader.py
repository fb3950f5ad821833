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

Split by concern: opening (this module: finding the save, checking it, retrying when a newer save replaces it),
`_reader_view` (names, specs, reads, `verify` on the files held open), `_held_files` (reads from open descriptors),
`_held_directory` (opening inside the held directory) and `_reader_formats` (file names, kinds and formats).
"""

from __future__ import annotations

import contextlib
import os
import stat
from contextvars import ContextVar
from pathlib import Path

import torch

from cx_checkpoint._errors import (
    CheckpointError,
    CheckpointIndexError,
    CheckpointKindError,
    CheckpointNotFoundError,
    CorruptShardError,
    MissingShardError,
)
from cx_checkpoint._files import load_bin, read_safetensors_header
from cx_checkpoint._held_directory import _open_directory, _open_inside, _Replaced, _replaced
from cx_checkpoint._held_files import _close_all, _OpenFile, _read_all
from cx_checkpoint._index import CheckpointIndexFile, is_plain_file_name
from cx_checkpoint._naming import CheckpointKind, FileFormat
from cx_checkpoint._protocols import TensorSpec
from cx_checkpoint._reader_formats import _BIN_SUFFIXES, _check_kind, _families, _single_file_format
from cx_checkpoint._reader_view import _CheckpointView

__all__ = ["VERIFY_BY_DEFAULT", "CheckpointReader"]

_OPEN_ATTEMPTS = 50

VERIFY_BY_DEFAULT: ContextVar[bool] = ContextVar("cx_checkpoint_verify", default=False)
"""What `CheckpointReader.open(verify=None)` does; `CheckpointIO.load_*(verify=True)` sets it around a load, so
plugins' own readers verify too."""


class CheckpointReader(_CheckpointView):
    """Names, full shapes and dtypes of a checkpoint's tensors, and reads of whole tensors or regions."""

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

    # ---- closing -------------------------------------------------------------------------------------------------
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
