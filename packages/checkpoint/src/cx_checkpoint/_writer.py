"""The streaming shard writer and the sharded save: (name, tensor) pairs in any order become HF-layout shard files.

`ShardWriter` buffers tensors until the next one would push the shard past the size limit, then writes and fsyncs
that shard under a temporary part name (a tensor larger than the limit gets a shard of its own). `write_sharded`
runs one save end to end: staging directory, the writer, final `-0000i-of-0000n` names, the index (last), then the
atomic commit. Given a process group, every rank streams its own tensors into the same staging directory in
parallel; rank 0 renames all parts, merges one index and commits. Each phase ends with a status exchange so that an
error on any rank is raised on every rank instead of leaving the others waiting in a collective.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from cx_checkpoint._atomic import (
    commit_directory,
    fsync_file,
    new_token,
    remove_stale_staging,
    staging_path,
)
from cx_checkpoint._checksum import file_checksum
from cx_checkpoint._errors import CheckpointError, CheckpointPathError
from cx_checkpoint._files import write_bin, write_safetensors
from cx_checkpoint._index import CheckpointIndexFile
from cx_checkpoint._naming import CheckpointKind, FileFormat, FileNames, file_names
from cx_mesh import ProcessGroup, all_gather_bytes, assert_same_across_ranks

__all__ = ["ShardWriter", "WrittenShard", "megabytes_to_bytes", "write_sharded"]

_T = TypeVar("_T")


def megabytes_to_bytes(size_per_shard: float) -> int:
    """`size_per_shard` is in MB (2**20 bytes), as in ColossalAI; it must be positive."""
    if isinstance(size_per_shard, bool) or not isinstance(size_per_shard, int | float) or not size_per_shard > 0:
        raise ValueError(f"size_per_shard must be a positive number of MB, got {size_per_shard!r}")
    return max(1, int(size_per_shard * 1024 * 1024))


@dataclass(frozen=True)
class WrittenShard:
    """One shard file written under a temporary name: the tensors in it and their byte sizes."""

    file_name: str
    tensors: tuple[tuple[str, int], ...]
    checksum: str = ""
    """The file's checksum (`"crc32:<hex>"`), recorded in the index."""


class ShardWriter:
    """Cuts a stream of (name, tensor) pairs into shard files of at most `max_shard_bytes` each, in `directory`."""

    def __init__(
        self,
        directory: Path,
        *,
        file_format: FileFormat,
        max_shard_bytes: int,
        metadata: Mapping[str, str],
        part_prefix: str = "part-",
    ) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self._directory = directory
        self._format = file_format
        self._limit = max_shard_bytes
        self._metadata = dict(metadata)
        self._prefix = part_prefix
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._seen: set[str] = set()
        self._written: list[WrittenShard] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if name in self._seen:
            raise ValueError(f"tensor {name!r} was given twice to the shard writer")
        self._seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self._limit:
            self._flush()
        self._pending[name] = tensor
        self._pending_bytes += nbytes

    def extend(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def close(self) -> list[WrittenShard]:
        """Write what is buffered and return every shard written, in order."""
        if self._pending:
            self._flush()
        return list(self._written)

    def _flush(self) -> None:
        file_name = f"{self._prefix}{len(self._written):05d}.tmp"
        path = self._directory / file_name
        if self._format is FileFormat.SAFETENSORS:
            checksum = write_safetensors(path, self._pending, self._metadata)
        else:
            checksum = write_bin(path, self._pending)
        fsync_file(path)
        sizes = tuple((name, t.numel() * t.element_size()) for name, t in self._pending.items())
        self._written.append(WrittenShard(file_name, sizes, checksum))
        self._pending = {}
        self._pending_bytes = 0


def write_sharded(
    directory: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    kind: CheckpointKind = CheckpointKind.MODEL,
    file_format: FileFormat = FileFormat.SAFETENSORS,
    size_per_shard: float = 1024,
    prefix: str | None = None,
    group: ProcessGroup | None = None,
    extra_files: Callable[[Path], object] | None = None,
) -> CheckpointIndexFile:
    """Save a stream of full tensors as a sharded checkpoint directory, atomically; returns the index.

    With `group`, this is collective: every rank of the group calls it with its own (disjoint) tensors and they are
    written in parallel into one checkpoint (the directory must be on a file system all ranks share). `extra_files`
    is called with the staging directory on rank 0 to add side files (configs, optimizer JSON) before the commit;
    their checksums go into the index with the shards', so verification covers them too.
    """
    target = Path(directory)
    prefix = prefix or None  # "" is no prefix (ColossalAI's add_prefix), also for the ranks' agreement below
    names = file_names(kind, file_format, prefix)
    max_bytes = megabytes_to_bytes(size_per_shard)
    metadata = {"format": "pt", "cx_kind": kind.value}
    if group is None:
        _check_target(target)
        remove_stale_staging(target)
        staging = staging_path(target, new_token())
        staging.mkdir(parents=True)
        try:
            writer = ShardWriter(staging, file_format=file_format, max_shard_bytes=max_bytes, metadata=metadata)
            writer.extend(tensors)
            index = _finish(staging, target, [writer.close()], names, kind, prefix, extra_files)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return index

    assert_same_across_ranks(
        (str(target.absolute()), kind.value, file_format.value, max_bytes, prefix), group, "write_sharded arguments"
    )
    rank = dist.get_rank(group)
    token = all_gather_bytes(new_token().encode() if rank == 0 else b"", group)[0].decode()
    staging = staging_path(target, token)

    def prepare() -> None:
        if rank == 0:
            _check_target(target)
            remove_stale_staging(target)
            staging.mkdir(parents=True)

    _agree(group, prepare)
    try:

        def write_mine() -> list[WrittenShard]:
            writer = ShardWriter(
                staging,
                file_format=file_format,
                max_shard_bytes=max_bytes,
                metadata=metadata,
                part_prefix=f"rank{rank:05d}-part-",
            )
            stream = iter(tensors)
            try:
                writer.extend(stream)
            except BaseException:
                # the stream may gather across ranks (tensor-parallel shards): consume the rest so every rank
                # makes the same collective calls before the failure is shared at the status exchange
                for _ in stream:
                    pass
                raise
            return writer.close()

        written = _agree(group, write_mine, encode=_encode_shards, decode=_decode_shards)

        def commit() -> str:
            if rank == 0:
                return _finish(staging, target, written, names, kind, prefix, extra_files).to_json()
            return ""

        index_json = _agree(group, commit)[0]
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return CheckpointIndexFile.from_mapping(json.loads(index_json), str(target))


def _check_target(target: Path) -> None:
    if target.exists() and not target.is_dir():
        raise CheckpointPathError(f"{target} exists and is a file; a sharded checkpoint is a directory")


def _finish(
    staging: Path,
    target: Path,
    written: list[list[WrittenShard]],
    names: FileNames,
    kind: CheckpointKind,
    prefix: str | None,
    extra_files: Callable[[Path], object] | None,
) -> CheckpointIndexFile:
    """Rename parts to their final names, add side files, write the index last, carry over foreign files, commit."""
    shards = [shard for per_rank in written for shard in per_rank]
    index = CheckpointIndexFile()
    for number, shard in enumerate(shards, start=1):
        final = names.shard(number, len(shards))
        for name, nbytes in shard.tensors:
            index.add(name, final, nbytes)
        if shard.checksum:
            index.checksums[final] = shard.checksum
        os.rename(staging / shard.file_name, staging / final)
    if extra_files is not None:
        before = set(os.listdir(staging))
        extra_files(staging)
        for added in sorted(set(os.listdir(staging)) - before):
            if (staging / added).is_file():
                fsync_file(staging / added)
                index.checksums[added] = _whole_file_checksum(staging / added)  # side files are verified too
    index.write(staging / names.index)
    fsync_file(staging / names.index)
    _carry_over(target, staging, kind, prefix)
    commit_directory(staging, target)
    return index


def _whole_file_checksum(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_checksum(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _owned_by_kind(file_name: str, kind: CheckpointKind, prefix: str | None) -> bool:
    """Files a new save of `kind` replaces in an existing directory (its own families, in every format)."""
    formats = [FileFormat.SAFETENSORS] if kind is CheckpointKind.OPTIMIZER else list(FileFormat)
    families = [file_names(kind, fmt, prefix) for fmt in formats]
    return any(family.owns(file_name) for family in families) or (
        kind is CheckpointKind.OPTIMIZER and file_name == families[0].optimizer_json
    )


def _carry_over(target: Path, staging: Path, kind: CheckpointKind, prefix: str | None) -> None:
    """Keep the old directory's files this save does not own (a model beside an optimizer, tokenizer files)."""
    if not target.is_dir():
        return
    present = set(os.listdir(staging))
    for entry in sorted(os.listdir(target)):
        if entry in present or _owned_by_kind(entry, kind, prefix) or ".cx-staging-" in entry:
            continue
        source, destination = target / entry, staging / entry
        if source.is_symlink():
            os.symlink(os.readlink(source), destination)
        elif source.is_dir():
            shutil.copytree(source, destination, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(destination))


def _link_or_copy(source: str, destination: str) -> str:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)
        fsync_file(Path(destination))
    return destination


def _encode_shards(shards: list[WrittenShard]) -> Any:
    return [[shard.file_name, [list(t) for t in shard.tensors], shard.checksum] for shard in shards]


def _decode_shards(data: Any) -> list[WrittenShard]:
    return [WrittenShard(str(f), tuple((str(n), int(b)) for n, b in ts), str(c)) for f, ts, c in data]


def _agree(
    group: ProcessGroup,
    step: Callable[[], _T],
    encode: Callable[[_T], Any] = lambda value: value,
    decode: Callable[[Any], _T] = lambda value: value,
) -> list[_T]:
    """Run `step` on every rank and exchange outcomes; any rank's failure is raised on all ranks."""
    rank = dist.get_rank(group)
    failure: BaseException | None = None
    try:
        report: dict[str, Any] = {"ok": True, "value": encode(step())}
    except Exception as error:
        failure = error
        report = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    reports = [json.loads(raw) for raw in all_gather_bytes(json.dumps(report).encode(), group)]
    if failure is not None:
        raise failure
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if not rep["ok"]]
    if failed:
        detail = "; ".join(f"rank {r}: {message}" for r, message in failed)
        raise CheckpointError(
            f"parallel checkpoint write failed on rank(s) {[r for r, _ in failed]} ({detail}); rank {rank} stopped too"
        )
    return [decode(rep["value"]) for rep in reports]
