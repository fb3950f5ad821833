"""Checksums of checkpoint files: recorded at save, compared on request (`verify=True`, `cx-checkpoint-verify`).

A checksum is `"crc32:<8 hex digits>"` (zlib's CRC-32, a few GB/s): it catches bit rot, truncated or partial copies
and edits, not deliberate tampering. The prefix names the algorithm, so a reader refuses one it does not know.
"""

from __future__ import annotations

import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

from cx_checkpoint._errors import CorruptShardError

__all__ = ["CHECKSUM_ALGORITHM", "BackgroundCrc32", "Crc32", "checksum_of", "file_checksum"]

CHECKSUM_ALGORITHM = "crc32"
_BLOCK = 16 * 1024 * 1024


class Crc32:
    """A running CRC-32 over the bytes given to `update`."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{CHECKSUM_ALGORITHM}:{self._value:08x}"


_HELPER: ThreadPoolExecutor | None = None
_HELPER_LOCK = threading.Lock()


def _helper() -> ThreadPoolExecutor:
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None:
            _HELPER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cx-checkpoint-crc")
        return _HELPER


def _forget_helper_after_fork() -> None:
    """A forked child has no copy of the helper thread: it starts its own on first use (else jobs would wait
    forever for a thread that does not exist)."""
    global _HELPER, _HELPER_LOCK
    _HELPER, _HELPER_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper_after_fork)


class BackgroundCrc32:
    """A CRC-32 computed on a helper thread while the caller writes the same bytes: zlib releases the GIL, so the
    checksum overlaps the write instead of adding a pass over the data. The caller keeps every buffer alive and
    unchanged until `hexdigest()` returns."""

    def __init__(self) -> None:
        self._value = 0
        self._pending: list[Future[None]] = []

    def update(self, data: bytes | memoryview) -> None:
        self._pending.append(_helper().submit(self._add, data))  # one worker: jobs run in submission order

    def _add(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        for future in self._pending:
            future.result()
        self._pending = []
        return f"{CHECKSUM_ALGORITHM}:{self._value:08x}"


def _check_algorithm(expected: str | None) -> None:
    if expected is not None and not expected.startswith(f"{CHECKSUM_ALGORITHM}:"):
        raise CorruptShardError(
            f"unknown checksum algorithm in {expected!r} (this cx-checkpoint knows {CHECKSUM_ALGORITHM})"
        )


def checksum_of(data: bytes | memoryview, expected: str | None = None) -> str:
    """The checksum of bytes in memory (`expected` must name a known algorithm, else `CorruptShardError`)."""
    _check_algorithm(expected)
    crc = Crc32()
    for start in range(0, len(data), _BLOCK):
        crc.update(data[start : start + _BLOCK])
    return crc.hexdigest()


def file_checksum(fd: int, offset: int, length: int, expected: str | None = None) -> str:
    """The checksum of `length` bytes of the open file `fd` from `offset`, read in blocks.

    `expected` (a recorded checksum) must name an algorithm this reader knows, else `CorruptShardError`."""
    if expected is not None and not expected.startswith(f"{CHECKSUM_ALGORITHM}:"):
        raise CorruptShardError(
            f"unknown checksum algorithm in {expected!r} (this cx-checkpoint knows {CHECKSUM_ALGORITHM})"
        )
    crc = Crc32()
    end = offset + length
    while offset < end:
        block = os.pread(fd, min(_BLOCK, end - offset), offset)
        if not block:
            break  # a short file: the checksum then differs, which is what is reported
        crc.update(block)
        offset += len(block)
    return crc.hexdigest()
