"""Checksums of checkpoint files: recorded at save, compared on request (`verify=True`, `cx-checkpoint-verify`).

A checksum is `"crc32:<8 hex digits>"` (zlib's CRC-32, a few GB/s): it catches bit rot, truncated or partial copies
and edits, not deliberate tampering. The prefix names the algorithm, so a reader refuses one it does not know.
"""

from __future__ import annotations

import os
import zlib

from cx_checkpoint._errors import CorruptShardError

__all__ = ["CHECKSUM_ALGORITHM", "Crc32", "file_checksum"]

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
