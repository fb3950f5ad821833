"""`ChunkScheduler`: drives a `ChunkManager` period by period under a placement policy, with prefetch.

cx-zero's hooks call, per training step: `begin_step()`; for every operation `access(params)` before it and
`release(params)` after it (tensor state transitions are the caller's); `end_step()`. The first step is the warm-up
(unless a `MemStats` recorded before training is given): a `MemoryTracer` records each period's tensors and
non-model bytes, which become a `StepTrace` at `end_step` (non-model figures agreed across the group with a MAX
all-reduce, so every rank takes the same decisions and issues the same collectives). After warm-up, with
`max_prefetch = k`, each `access` also starts gathering those of the next k distinct chunks in recorded order that
are not gathered yet (asynchronously where the backend allows; on CPU/gloo it is still correct), and `release`
keeps a chunk gathered when the next recorded period uses it again (no shard/re-gather pair). A step whose
accesses leave the recorded order stops prefetching until it ends: the trace no longer says what comes next, and
ranks that took different orders would otherwise issue different numbers of gathers (a hang or a crash) instead of
the same number in a different order (which cx-zero's path check reports).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cx_chunk._chunk import Chunk
from cx_chunk._layout import Residence
from cx_chunk._manager import ChunkManager
from cx_chunk._memstats import MemoryTracer, MemStats
from cx_chunk._policy import PlacementPolicy, in_use
from cx_chunk._trace import StepTrace
from cx_mesh import all_reduce, communication_device

__all__ = ["ChunkScheduler"]


class ChunkScheduler:
    def __init__(
        self,
        manager: ChunkManager,
        policy: PlacementPolicy,
        *,
        max_prefetch: int = 0,
        memstats: MemStats | None = None,
    ) -> None:
        if max_prefetch < 0:
            raise ValueError(f"ChunkScheduler: max_prefetch must be >= 0, got {max_prefetch}")
        self.manager = manager
        self.policy = policy
        self.max_prefetch = max_prefetch
        self.tracer = MemoryTracer(model_bytes=lambda: manager.usage.device)
        self.trace: StepTrace | None = self._build_trace(memstats) if memstats is not None and len(memstats) else None
        self.prefetch_log: list[tuple[int, int]] = []
        self._period = 0
        self._in_step = False
        self._off_trace = False
        policy.setup(manager)

    @property
    def warmed_up(self) -> bool:
        return self.trace is not None

    @property
    def off_trace(self) -> bool:
        """Whether the running step's accesses have left the recorded order (prefetch is off until the step ends)."""
        return self._off_trace

    @property
    def period(self) -> int:
        """Index of the next period in the current step."""
        return self._period

    def begin_step(self) -> None:
        if self._in_step:
            raise RuntimeError("ChunkScheduler.begin_step: the previous step was not ended (call end_step)")
        self._in_step = True
        self._period = 0
        self._off_trace = False

    def access(self, tensors: Sequence[torch.Tensor], *, non_model_bytes: int | None = None) -> list[Chunk]:
        """Start a period using `tensors`: make room, gather their chunks, prefetch; returns the chunks."""
        if not self._in_step:
            raise RuntimeError("ChunkScheduler.access: call begin_step() first")
        period = self._period
        self._period += 1
        chunks = self.manager.chunks_of(tensors)
        if self.trace is None:
            self.tracer.record(tensors, non_model_bytes=non_model_bytes)
        self.policy.prepare(self.manager, chunks, period, self.trace)
        for chunk in chunks:  # all started before any is waited for: several gathers in flight at once
            self.manager.access_chunk(chunk, async_op=True)
        for chunk in chunks:
            self.manager.wait_chunk(chunk)
        self.policy.after_access(self.manager, period, self.trace)
        if self.trace is not None and not self._off_trace:
            recorded = self.trace.chunks_per_period
            self._off_trace = period >= len(recorded) or recorded[period] != frozenset(chunks)
        if self.trace is not None and self.max_prefetch and not self._off_trace:
            self._prefetch(period)
        return chunks

    def release(self, tensors: Sequence[torch.Tensor]) -> None:
        """End of use: each chunk none of whose tensors is still in use goes to the policy (shard, keep, offload).
        A chunk with a tensor still in use (shared by an enclosing operation) stays gathered until then."""
        following = self._period  # index of the period after the one that just ran
        for chunk in self.manager.chunks_of(tensors):
            if in_use(chunk):  # keep_gathered chunks too: unmarked, the policy could evict them under the operation
                continue
            self.manager.mark_unused(chunk)
            if (
                self.trace is not None
                and following < len(self.trace)
                and chunk in self.trace.chunks_per_period[following]
            ):
                continue  # the next period uses it again: keep it gathered rather than shard and re-gather
            self.policy.after_use(self.manager, chunk)

    def end_step(self) -> None:
        if not self._in_step:
            raise RuntimeError("ChunkScheduler.end_step: no step in progress")
        self._in_step = False
        if self.trace is None:
            self.tracer.finish()
            self.trace = self._build_trace(self.tracer.memstats)

    def _prefetch(self, period: int) -> None:
        assert self.trace is not None
        for chunk in itertools.islice(self.trace._iter_upcoming(period), self.max_prefetch):
            if chunk.is_gathered and chunk.residence is Residence.DEVICE:
                continue  # already ahead of use (gathered earlier, or in use now)
            if not self.policy.admits_prefetch(self.manager, chunk, period, self.trace):
                break
            self.manager.prefetch_chunk(chunk)
            self.prefetch_log.append((period, chunk.chunk_id))

    def _build_trace(self, memstats: MemStats) -> StepTrace:
        figures = torch.tensor([p.non_model_bytes for p in memstats.periods], dtype=torch.int64)
        if len(figures):
            figures = figures.to(communication_device(self.manager.group))
            all_reduce(figures, op=dist.ReduceOp.MAX, group=self.manager.group)
        chunks = tuple(frozenset(self.manager.chunks_of(p.tensors)) for p in memstats.periods)
        return StepTrace(chunks, tuple(int(v) for v in figures.tolist()))
