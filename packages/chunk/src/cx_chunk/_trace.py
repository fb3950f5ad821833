"""`StepTrace`: a recorded step seen as chunks: which chunks each period uses and its non-model bytes.

Built from a `MemStats` and a `ChunkManager` at the end of warm-up. It answers the two questions placement needs:
how much non-model memory the next period needs, and when a chunk is next used (for Belady eviction and prefetch).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cx_chunk._chunk import Chunk

__all__ = ["StepTrace"]


@dataclass(frozen=True)
class StepTrace:
    chunks_per_period: tuple[frozenset[Chunk], ...]
    non_model_per_period: tuple[int, ...]
    _uses: dict[Chunk, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.chunks_per_period) != len(self.non_model_per_period):
            raise ValueError("StepTrace: one non-model figure per period is needed")
        uses: dict[Chunk, list[int]] = {}
        for period, chunks in enumerate(self.chunks_per_period):
            for chunk in chunks:
                uses.setdefault(chunk, []).append(period)
        # each chunk's periods, sorted: next_use is a binary search instead of a scan of the step (it runs for every
        # eviction candidate of every period)
        object.__setattr__(self, "_uses", {chunk: tuple(periods) for chunk, periods in uses.items()})

    def __len__(self) -> int:
        return len(self.chunks_per_period)

    def non_model(self, period: int) -> int:
        """Non-model bytes of `period`; past the recorded step, the largest recorded."""
        if 0 <= period < len(self.non_model_per_period):
            return self.non_model_per_period[period]
        return max(self.non_model_per_period, default=0)

    def next_use(self, chunk: Chunk, after: int) -> int | None:
        """The first period after `after` that uses `chunk`, or None when the rest of the step does not."""
        periods = self._uses.get(chunk, ())
        position = bisect.bisect_right(periods, after)
        return periods[position] if position < len(periods) else None

    def upcoming(self, after: int) -> Sequence[Chunk]:
        """Distinct chunks in order of first use after period `after`."""
        return list(self._iter_upcoming(after))

    def _iter_upcoming(self, after: int) -> Iterator[Chunk]:
        """`upcoming`, lazily: a caller that needs the first k stops after reading them (prefetch, every period)."""
        seen: set[Chunk] = set()
        for period in range(after + 1, len(self.chunks_per_period)):
            for chunk in sorted(self.chunks_per_period[period], key=lambda c: c.chunk_id):
                if chunk not in seen:
                    seen.add(chunk)
                    yield chunk
