"""`PlacementPolicy`: the decisions a `ChunkScheduler` delegates, per operation period.

- `setup`: initial residence once chunk groups are closed; master, gradient and state chunks that exist by then
  are placed too (later ones should be created with `residence=policy.optimizer_residence(chunk)`).
- `optimizer_residence`: where a chunk's master, gradient and optimizer-state data live.
- `prepare`: before the period's chunks are gathered, make room for them on the device.
- `after_access`: after they are gathered (bookkeeping, e.g. budget checks).
- `after_use`: a chunk none of whose tensors is in use any more: keep it gathered, shard it, offload it.
- `admits_prefetch`: whether gathering a chunk early fits.
- `keeps_gathered`: whether a chunk stays gathered between uses (its buffer must then keep parameter values).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from cx_chunk._chunk import Chunk
from cx_chunk._layout import Residence
from cx_chunk._manager import ChunkManager
from cx_chunk._states import TensorState
from cx_chunk._trace import StepTrace

__all__ = ["PlacementPolicy"]


class PlacementPolicy(ABC):
    @abstractmethod
    def setup(self, manager: ChunkManager) -> None: ...

    @abstractmethod
    def optimizer_residence(self, chunk: Chunk) -> Residence: ...

    def prepare(self, manager: ChunkManager, chunks: Sequence[Chunk], period: int, trace: StepTrace | None) -> None:
        """Make room for `chunks` before they are gathered (default: nothing to do)."""
        return

    def after_access(self, manager: ChunkManager, period: int, trace: StepTrace | None) -> None:
        """Called once the period's chunks are gathered (default: nothing to do)."""
        return

    @abstractmethod
    def after_use(self, manager: ChunkManager, chunk: Chunk) -> None: ...

    def admits_prefetch(self, manager: ChunkManager, chunk: Chunk, period: int, trace: StepTrace) -> bool:
        """Whether `chunk` may be gathered ahead of use during `period` (default: always)."""
        return True

    def keeps_gathered(self, chunk: Chunk) -> bool:
        """Whether the policy keeps `chunk` gathered between uses (default: no chunk)."""
        return False


_IN_USE = (TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD, TensorState.READY_FOR_REDUCE)


def in_use(chunk: Chunk) -> bool:
    """Whether any tensor of `chunk` is in use (not HOLD or FREE); unlike `Chunk.can_release` this also holds for
    keep_gathered chunks, which are never sharded but can still be moved to the host."""
    counts = chunk.state_counts()
    return any(counts[state] for state in _IN_USE)


def gather_cost(chunk: Chunk) -> int:
    """Extra device bytes at the peak of gathering `chunk` (an upper bound on what it adds afterwards).

    0 when it is gathered on the device already. When its own slice is the whole chunk (keep_gathered, or a group
    of one) gathering moves that storage to the device. Otherwise the all-gather writes a new full buffer while
    the own slice (moved to the device first when on the host) still exists.
    """
    if chunk.is_gathered and chunk.residence is Residence.DEVICE:
        return 0
    on_device = chunk.residence is Residence.DEVICE
    if chunk.shard_size == chunk.chunk_size:
        return 0 if on_device else chunk.nbytes
    return chunk.nbytes + (0 if on_device else chunk.shard_nbytes)


def release_headroom(manager: ChunkManager, chunks: Sequence[Chunk] = ()) -> int:
    """Device bytes that releasing a chunk may briefly add on top of a period's gathers: releasing copies the own
    slice out of the buffer before freeing it. For a chunk gathered during the period its gather's peak already
    covers this, so only chunks gathered before (in use, or among `chunks` and kept from an earlier period) count;
    releases happen one at a time, so the largest such slice."""
    candidates = {*manager.accessed, *chunks}
    return max(
        (c.shard_nbytes for c in candidates if c.is_gathered and not c.keep_gathered and c.shard_size != c.chunk_size),
        default=0,
    )
