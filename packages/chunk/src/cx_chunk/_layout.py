"""Small value types describing where tensors and bytes live: slots, shard views, residence, memory usage."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["MemoryUsage", "Residence", "ShardView", "TensorSlot"]


class Residence(enum.Enum):
    """The two device kinds a chunk's storage can live on (on a CPU-only machine both are host RAM)."""

    DEVICE = "device"  # the compute device (cx_mesh.get_accelerator().current_device())
    HOST = "host"  # host memory (pinned when asked for and available)


@dataclass(frozen=True)
class TensorSlot:
    """One tensor's place in a chunk: elements [begin, end) of the chunk's 1-D buffer hold it, flattened."""

    name: str
    shape: torch.Size
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardView:
    """The part of one tensor that falls in this rank's own slice of a chunk, for a sharded optimizer.

    Elements [tensor_begin, tensor_end) of the flattened tensor are elements [shard_begin, shard_end) of this rank's
    shard (the own slice, `Chunk.shard_tensor()`).
    """

    name: str
    tensor_begin: int
    tensor_end: int
    shard_begin: int
    shard_end: int

    @property
    def numel(self) -> int:
        return self.tensor_end - self.tensor_begin


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes of chunk payload resident on the compute device and on the host."""

    device: int = 0
    host: int = 0

    def __add__(self, other: MemoryUsage) -> MemoryUsage:
        return MemoryUsage(self.device + other.device, self.host + other.host)

    def __sub__(self, other: MemoryUsage) -> MemoryUsage:
        return MemoryUsage(self.device - other.device, self.host - other.host)

    def of(self, residence: Residence) -> int:
        """Bytes on one device kind."""
        return self.device if residence is Residence.DEVICE else self.host

    @staticmethod
    def single(residence: Residence, nbytes: int) -> MemoryUsage:
        return MemoryUsage(device=nbytes) if residence is Residence.DEVICE else MemoryUsage(host=nbytes)
