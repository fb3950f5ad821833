"""`MemStats` and `MemoryTracer`: what a warm-up step (or a run before training) learned about memory and order.

A period is one operation (a module's forward or backward) between two chunk accesses. For each period the tracer
records the tensors it used and the non-model memory (activations, workspace) in use, so a placement policy can
reserve room for it and evict by next use. cx-zero's hooks call `MemoryTracer.record` at period boundaries; this
package installs no hooks itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from cx_mesh import get_accelerator

__all__ = ["MemStats", "MemoryTracer", "PeriodRecord"]


@dataclass(frozen=True)
class PeriodRecord:
    """One operation period: its index, the tensors it used, and the non-model / model bytes measured."""

    index: int
    tensors: tuple[torch.Tensor, ...]
    non_model_bytes: int
    model_bytes: int


class MemStats:
    """Per-period non-model memory and the order in which parameters were first used."""

    def __init__(self) -> None:
        self.periods: list[PeriodRecord] = []
        self._param_order: list[torch.Tensor] = []
        self._seen: set[int] = set()

    def __len__(self) -> int:
        return len(self.periods)

    def record_period(
        self, tensors: Sequence[torch.Tensor], non_model_bytes: int, model_bytes: int = 0
    ) -> PeriodRecord:
        if non_model_bytes < 0 or model_bytes < 0:
            raise ValueError(
                f"MemStats: byte counts must be >= 0, got non-model {non_model_bytes}, model {model_bytes}"
            )
        record = PeriodRecord(len(self.periods), tuple(tensors), non_model_bytes, model_bytes)
        self.periods.append(record)
        for tensor in tensors:
            if id(tensor) not in self._seen:
                self._seen.add(id(tensor))
                self._param_order.append(tensor)
        return record

    @property
    def param_order(self) -> list[torch.Tensor]:
        """Tensors in the order of their first use."""
        return list(self._param_order)

    def non_model_bytes(self, period: int) -> int:
        """Non-model bytes of a period; periods past the end of the record use the largest one recorded."""
        if 0 <= period < len(self.periods):
            return self.periods[period].non_model_bytes
        return self.max_non_model_bytes()

    def max_non_model_bytes(self) -> int:
        return max((p.non_model_bytes for p in self.periods), default=0)

    def clear(self) -> None:
        self.periods.clear()
        self._param_order.clear()
        self._seen.clear()


class MemoryTracer:
    """Records periods into a `MemStats`, measuring non-model memory when it is not given.

    A measured period's non-model bytes are the accelerator's peak between its own `record` and the next one (or
    `finish`), minus the model bytes (`model_bytes()`, e.g. a ChunkManager's device usage): the peak taken when
    period t+1 starts belongs to period t, not to t+1. Until then a period holds the non-model bytes in use when it
    started; `finish` (called by `ChunkScheduler.end_step`) attributes the last period's peak. On CPU the peak cannot
    be reset (it is the process's), so CPU callers pass `non_model_bytes` explicitly.
    """

    def __init__(self, memstats: MemStats | None = None, *, model_bytes: Callable[[], int] | None = None) -> None:
        self.memstats = memstats if memstats is not None else MemStats()
        self._model_bytes = model_bytes if model_bytes is not None else (lambda: 0)
        self._measuring: PeriodRecord | None = None

    def record(self, tensors: Sequence[torch.Tensor], *, non_model_bytes: int | None = None) -> PeriodRecord:
        self.finish()
        model = self._model_bytes()
        if non_model_bytes is not None:
            return self.memstats.record_period(tensors, non_model_bytes, model)
        accelerator = get_accelerator()
        record = self.memstats.record_period(tensors, max(0, accelerator.memory_allocated() - model), model)
        accelerator.reset_peak_memory_stats()
        self._measuring = record
        return record

    def finish(self) -> None:
        """Attribute the peak since the last measured `record` to that period (no-op when none is open)."""
        record, self._measuring = self._measuring, None
        periods = self.memstats.periods
        if record is None or record.index >= len(periods) or periods[record.index] is not record:
            return
        model = max(record.model_bytes, self._model_bytes())
        peak = max(0, get_accelerator().max_memory_allocated() - model)
        periods[record.index] = replace(record, non_model_bytes=max(record.non_model_bytes, peak))
