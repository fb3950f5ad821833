"""`StepTrace`: a recorded step seen as chunks: which chunks each period uses and its non-model bytes.

Built from a `MemStats` and a `ChunkManager` at the end of warm-up. It answers the two questions placement needs:
how much non-model memory the next period needs, and when a chunk is next used (for Belady eviction and prefetch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cx_chunk._chunk import Chunk

__all__ = ["StepTrace"]


@dataclass(frozen=True)
class StepTrace:
    chunks_per_period: tuple[frozenset[Chunk], ...]
    non_model_per_period: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.chunks_per_period) != len(self.non_model_per_period):
            raise ValueError("StepTrace: one non-model figure per period is needed")

    def __len__(self) -> int:
        return len(self.chunks_per_period)

    def non_model(self, period: int) -> int:
        """Non-model bytes of `period`; past the recorded step, the largest recorded."""
        if 0 <= period < len(self.non_model_per_period):
            return self.non_model_per_period[period]
        return max(self.non_model_per_period, default=0)

    def next_use(self, chunk: Chunk, after: int) -> int | None:
        """The first period after `after` that uses `chunk`, or None when the rest of the step does not."""
        for period in range(after + 1, len(self.chunks_per_period)):
            if chunk in self.chunks_per_period[period]:
                return period
        return None

    def upcoming(self, after: int) -> Sequence[Chunk]:
        """Distinct chunks in order of first use after period `after`."""
        order: list[Chunk] = []
        for period in range(after + 1, len(self.chunks_per_period)):
            for chunk in sorted(self.chunks_per_period[period], key=lambda c: c.chunk_id):
                if chunk not in order:
                    order.append(chunk)
        return order
