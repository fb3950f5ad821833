"""`ChunkConfig`: how a chunk group lays tensors out (the result of `search_chunk_configuration`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkConfig"]


@dataclass(frozen=True)
class ChunkConfig:
    """Chunk size in elements; whether chunks stay gathered (plain DDP); the size above which a tensor gets a chunk
    of its own (an outlier, found by the search; None: only tensors larger than `chunk_size` do)."""

    chunk_size: int
    keep_gathered: bool = False
    separate_above: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"ChunkConfig: chunk_size must be positive, got {self.chunk_size}")
        if self.separate_above is not None and self.separate_above < 0:
            raise ValueError(f"ChunkConfig: separate_above must be >= 0, got {self.separate_above}")

    def gets_own_chunk(self, numel: int) -> bool:
        """Whether a tensor of `numel` elements is placed in a chunk of its own."""
        return numel > self.chunk_size or (self.separate_above is not None and numel > self.separate_above)
