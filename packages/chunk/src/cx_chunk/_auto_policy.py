"""`AutoPlacementPolicy`: keep model data within a device budget computed from a warm-up trace.

Capacity C is `capacity_bytes` when given, else `cx_mesh.get_accelerator().total_memory()` (which
`set_memory_capacity` can override). The budget for chunk payload on the device during period t is
- warm-up (no trace yet): C * (1 - warmup_non_model_data_ratio);
- afterwards: C * steady_cuda_cap_ratio - non_model(t), the non-model bytes the trace recorded for period t.
Before a period's chunks are gathered, chunks not in use are evicted to the host (own slice copied straight there)
until the period's need fits: the peak of its gathers (a new buffer while the shard exists) plus the largest own
slice that releasing an already-gathered chunk briefly copies (the same test admits a prefetch). Eviction order:
after warm-up the one whose next use is farthest away first (Belady/OPT; never used again this step first), during
warm-up the least recently used first. When even evicting everything movable does not reach the budget but the
need still fits under C * steady_cuda_cap_ratio (the non-model estimate was too pessimistic), the policy evicts
everything it can and proceeds (falls back to the host) instead of failing; only a period whose own chunks cannot
fit under C * steady_cuda_cap_ratio raises `BudgetError`, naming the budget and the need. Master, gradient and
optimizer-state chunks live on the host (as in ColossalAI's auto placement), except those of chunks given to
`keep_optimizer_on_device`: a caller that measured spare device memory after warm-up (`optimizer_margin`) moves
some chunks' optimizer data there (ColossalAI's `gpu_margin_mem_ratio`); the bytes it holds outside chunks
(optimizer state tensors) are reserved, i.e. taken off every later budget.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

from cx_chunk._chunk import Chunk
from cx_chunk._errors import BudgetError
from cx_chunk._layout import Residence
from cx_chunk._manager import ChunkManager
from cx_chunk._policy import PlacementPolicy, gather_cost, in_use, release_headroom
from cx_chunk._trace import StepTrace
from cx_mesh import get_accelerator

__all__ = ["AutoPlacementPolicy", "BudgetRecord", "Eviction"]


@dataclass(frozen=True)
class BudgetRecord:
    """After the chunks of `period` were gathered: the budget, the device bytes in use, whether it fell back."""

    period: int
    budget: int
    device_bytes: int
    fell_back: bool


@dataclass(frozen=True)
class Eviction:
    period: int
    chunk_id: int
    next_use: int | None


@dataclass(frozen=True)
class AutoPlacementPolicy(PlacementPolicy):
    warmup_non_model_data_ratio: float = 0.8
    steady_cuda_cap_ratio: float = 0.9
    capacity_bytes: int | None = None
    budget_log: list[BudgetRecord] = field(default_factory=list, init=False, repr=False, compare=False)
    evictions: list[Eviction] = field(default_factory=list, init=False, repr=False, compare=False)
    _last_use: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)
    _optimizer_on_device: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    _reserved: list[int] = field(default_factory=lambda: [0], init=False, repr=False, compare=False)
    _fell_back: set[int] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("warmup_non_model_data_ratio", "steady_cuda_cap_ratio"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"AutoPlacementPolicy: {name} must be in [0, 1], got {value}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"AutoPlacementPolicy: capacity_bytes must be positive, got {self.capacity_bytes}")

    # ---------------------------------------------------------------------------------------------- budget
    @property
    def capacity(self) -> int:
        return self.capacity_bytes if self.capacity_bytes is not None else get_accelerator().total_memory()

    @property
    def hard_limit(self) -> int:
        return int(self.capacity * self.steady_cuda_cap_ratio)

    def budget(self, period: int, trace: StepTrace | None) -> int:
        """Device bytes allowed for chunk payload during `period` (see the module docstring)."""
        if trace is None:
            return int(self.capacity * (1.0 - self.warmup_non_model_data_ratio)) - self.reserved_bytes
        return self.hard_limit - trace.non_model(period) - self.reserved_bytes

    @property
    def reserved_bytes(self) -> int:
        """Device bytes held outside chunks for optimizer data kept on the device (see the module docstring)."""
        return self._reserved[0]

    def optimizer_margin(self, manager: ChunkManager, trace: StepTrace) -> int:
        """Device bytes left over in steady state: the hard limit less the largest recorded non-model figure, the
        peak of chunk payload so far and what is reserved already (never negative)."""
        non_model = max(trace.non_model_per_period, default=0)
        return max(0, self.hard_limit - non_model - manager.peak.device - self.reserved_bytes)

    def keep_optimizer_on_device(self, manager: ChunkManager, chunk: Chunk, reserved_bytes: int = 0) -> None:
        """Move `chunk`'s master, gradient and optimizer-state chunks to the device and keep them there;
        `reserved_bytes`: device memory the caller adds outside chunks for it (optimizer state tensors)."""
        if reserved_bytes < 0:
            raise ValueError(f"keep_optimizer_on_device: reserved_bytes must be >= 0, got {reserved_bytes}")
        self._optimizer_on_device.add(chunk.chunk_id)
        self._reserved[0] += reserved_bytes
        for companion in manager.companions(chunk):
            if not companion.is_gathered:
                manager.move_chunk(companion, Residence.DEVICE)

    # ----------------------------------------------------------------------------------------------- hooks
    def setup(self, manager: ChunkManager) -> None:
        for chunk in manager.chunks():
            for companion in manager.companions(chunk):
                if not companion.is_gathered:
                    manager.move_chunk(companion, Residence.HOST)
        budget = self.budget(0, None)
        for chunk in reversed(manager.chunks()):
            if manager.usage.device <= budget:
                break
            if chunk.keep_gathered or not chunk.is_gathered:  # replicated chunks move whole
                manager.move_chunk(chunk, Residence.HOST)

    def optimizer_residence(self, chunk: Chunk) -> Residence:
        return Residence.DEVICE if chunk.chunk_id in self._optimizer_on_device else Residence.HOST

    def prepare(self, manager: ChunkManager, chunks: Sequence[Chunk], period: int, trace: StepTrace | None) -> None:
        for chunk in chunks:
            self._last_use[chunk.chunk_id] = period
        budget = self.budget(period, trace)
        need = sum(gather_cost(c) for c in chunks) + release_headroom(manager, chunks)
        if manager.usage.device + need <= budget:
            return
        candidates = self._candidates(manager, chunks)
        movable = sum(c.memory_usage().device for c in candidates)
        floor = manager.usage.device - movable + need
        if floor > self.hard_limit:
            raise BudgetError(
                f"AutoPlacementPolicy: period {period} needs {floor} bytes of chunks on the device ({need} to gather "
                f"{len(chunks)} chunk(s), {floor - need} that cannot move) but the budget is {budget} bytes and "
                f"the hard limit {self.hard_limit} bytes (capacity {self.capacity} x steady_cuda_cap_ratio "
                f"{self.steady_cuda_cap_ratio}); give the device more memory or use smaller chunks"
            )
        for chunk in self._eviction_order(candidates, period, trace):
            if manager.usage.device + need <= budget:
                break
            self.evictions.append(Eviction(period, chunk.chunk_id, trace.next_use(chunk, period) if trace else None))
            if chunk.is_gathered and not chunk.keep_gathered:
                manager.release_chunk(chunk, to=Residence.HOST)  # the own slice goes straight to the host
            manager.move_chunk(chunk, Residence.HOST)
        if manager.usage.device + need > budget:
            self._fell_back.add(period)
            warnings.warn(
                f"AutoPlacementPolicy: period {period} needs {manager.usage.device + need} device bytes, above its "
                f"budget of {budget} (recorded non-model data); everything movable is on the host, proceeding",
                RuntimeWarning,
                stacklevel=2,
            )

    def after_access(self, manager: ChunkManager, period: int, trace: StepTrace | None) -> None:
        self.budget_log.append(
            BudgetRecord(period, self.budget(period, trace), manager.usage.device, period in self._fell_back)
        )
        self._fell_back.discard(period)

    def after_use(self, manager: ChunkManager, chunk: Chunk) -> None:
        if not chunk.keep_gathered:
            manager.release_chunk(chunk)

    def admits_prefetch(self, manager: ChunkManager, chunk: Chunk, period: int, trace: StepTrace) -> bool:
        need = gather_cost(chunk) + release_headroom(manager)
        return manager.usage.device + need <= min(self.budget(period, trace), self.budget(period + 1, trace))

    # ------------------------------------------------------------------------------------------- internals
    def _candidates(self, manager: ChunkManager, needed: Sequence[Chunk]) -> list[Chunk]:
        """Parameter chunks holding device bytes that may move to the host now."""
        out = []
        for chunk in manager.chunks():
            if chunk in needed or chunk in manager.accessed or chunk.memory_usage().device == 0:
                continue
            if in_use(chunk):
                continue
            out.append(chunk)
        return out

    def _eviction_order(self, candidates: list[Chunk], period: int, trace: StepTrace | None) -> list[Chunk]:
        if trace is None:
            return sorted(candidates, key=lambda c: (self._last_use.get(c.chunk_id, -1), c.chunk_id))
        infinity = len(trace) + 1

        def distance(chunk: Chunk) -> tuple[int, int]:
            next_use = trace.next_use(chunk, period)
            return (infinity if next_use is None else next_use, chunk.chunk_id)

        return sorted(candidates, key=distance, reverse=True)
