"""`StaticPlacementPolicy`: fixed fractions decided once, as ColossalAI's static placement.

With B_i the full bytes of parameter chunk i (registration order), a fraction f selects chunk i when the bytes of
the chunks selected before it are below f * sum(B): `select(f)` (a greedy prefix by bytes).
- K = select(1 - shard_param_frac): chunks kept gathered after use (1.0 -> none: ZeRO-3; 0.0 -> all: ZeRO-2, where
  only gradients and optimizer data are sharded).
- O = select(offload_optim_frac) over chunks that are not keep_gathered by configuration: their master, gradient and
  optimizer-state chunks live on the host.
- P = select(offload_param_frac): their parameter shards live on the host while released. Only meaningful with
  shard_param_frac == offload_optim_frac == 1.0 (as in ColossalAI); anything else raises ValueError.
After a step in which every chunk was used and released, resident bytes are therefore:
  device = sum_{i in K} B_i + sum_{i in neither K nor P} S_i + sum_{i not in O} M_i
  host   = sum_{i in P} S_i + sum_{i in O} M_i
with S_i the parameter shard bytes and M_i the own-slice bytes of chunk i's master, gradient and state chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cx_chunk._chunk import Chunk
from cx_chunk._layout import Residence
from cx_chunk._manager import ChunkManager
from cx_chunk._policy import PlacementPolicy

__all__ = ["StaticPlacementPolicy", "select_by_fraction"]


def select_by_fraction(chunks: Sequence[Chunk], fraction: float, total: int) -> set[int]:
    """Chunk ids of the greedy prefix: a chunk is selected when the bytes selected before it are < fraction*total."""
    target = fraction * total
    selected: set[int] = set()
    taken = 0
    for chunk in chunks:
        if taken < target:
            selected.add(chunk.chunk_id)
            taken += chunk.nbytes
    return selected


@dataclass(frozen=True)
class StaticPlacementPolicy(PlacementPolicy):
    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    _kept: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    _offload_optim: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    _offload_param: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"StaticPlacementPolicy: {name} must be in [0, 1], got {value}")
        if self.offload_param_frac > 0 and (self.shard_param_frac != 1.0 or self.offload_optim_frac != 1.0):
            raise ValueError(
                "StaticPlacementPolicy: offload_param_frac > 0 is only supported with shard_param_frac=1.0 and "
                f"offload_optim_frac=1.0 (got shard_param_frac={self.shard_param_frac}, "
                f"offload_optim_frac={self.offload_optim_frac})"
            )

    @property
    def kept_gathered(self) -> frozenset[int]:
        return frozenset(self._kept)

    @property
    def optim_offloaded(self) -> frozenset[int]:
        return frozenset(self._offload_optim)

    @property
    def param_offloaded(self) -> frozenset[int]:
        return frozenset(self._offload_param)

    def setup(self, manager: ChunkManager) -> None:
        chunks = manager.chunks()
        total = sum(c.nbytes for c in chunks)
        self._kept.clear()
        self._offload_optim.clear()
        self._offload_param.clear()
        self._kept.update(select_by_fraction(chunks, 1.0 - self.shard_param_frac, total))
        eligible = [c for c in chunks if not c.keep_gathered]
        self._offload_optim.update(select_by_fraction(eligible, self.offload_optim_frac, total))
        self._offload_param.update(select_by_fraction(eligible, self.offload_param_frac, total))
        for chunk in chunks:
            if chunk.chunk_id in self._offload_param and not chunk.is_gathered:
                manager.move_chunk(chunk, Residence.HOST)
            for companion in manager.companions(chunk):
                if not companion.is_gathered:
                    manager.move_chunk(companion, self.optimizer_residence(chunk))

    def optimizer_residence(self, chunk: Chunk) -> Residence:
        return Residence.HOST if chunk.chunk_id in self._offload_optim else Residence.DEVICE

    def keeps_gathered(self, chunk: Chunk) -> bool:
        return chunk.chunk_id in self._kept or chunk.keep_gathered

    def after_use(self, manager: ChunkManager, chunk: Chunk) -> None:
        if chunk.chunk_id in self._kept or chunk.keep_gathered:
            return
        offload = chunk.chunk_id in self._offload_param
        manager.release_chunk(chunk, to=Residence.HOST if offload else None)
        if offload and not chunk.is_gathered:
            manager.move_chunk(chunk, Residence.HOST)
