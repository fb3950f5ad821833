"""`search_chunk_configuration`: the chunk size that wastes the least padding for a given parameter order.

The exact rule (units: elements; "m" arguments are multiples of 2**20 elements):
1. Sizes s_1..s_n are the parameters' element counts in the given order (shared tensors counted once).
2. If the total is below `min_chunk_size_m * 2**20`, everything becomes one keep_gathered chunk of the total rounded
   up to a multiple of `group_size` (plain DDP): waste is that rounding.
3. Outliers (only when `filter_exlarge_params` and n >= 2): s_i > mean + 3 * population std. Each gets a chunk of
   its own of s_i rounded up to `group_size`; the threshold is stored as `ChunkConfig.separate_above`.
4. The grid: start = the largest of `min_chunk_size` and the largest regular size, rounded up to a multiple of
   `search_interval` (default: `hidden_dim`, else 1024); candidates start + k * search_interval up to
   start + search_range_m * 2**20, each rounded up to a multiple of `group_size`.
5. A candidate's waste: next-fit packing in order (a tensor that does not fit closes the chunk and opens a new one),
   plus the unused tail of every chunk, plus the outliers' rounding. The smallest waste wins; ties go to the
   smaller size.
Returns `(config_dict, total_size, wasted_size)` in ColossalAI's shape, `config_dict` being
`{group_size: {"chunk_size": n, "keep_gathered": b, "separate_above": t}}` (what `GeminiDDP(chunk_config_dict=...)`
takes, editable the way ColossalAI's tests edit it); `.config` is the same as a `ChunkConfig`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from cx_chunk._config import ChunkConfig

__all__ = ["ChunkSearchResult", "next_fit_waste", "search_chunk_configuration"]

MEBI = 2**20


class ChunkSearchResult(NamedTuple):
    """Unpacks as ColossalAI's `(config_dict, total_size, waste)`; `config` is the typed form of `config_dict`."""

    config_dict: dict[int, dict[str, Any]]
    total_size: int
    wasted_size: int

    @classmethod
    def of(cls, config: ChunkConfig, group_size: int, total_size: int, wasted_size: int) -> ChunkSearchResult:
        entry = {"chunk_size": config.chunk_size, "keep_gathered": config.keep_gathered}
        if config.separate_above is not None:
            entry["separate_above"] = config.separate_above
        return cls({group_size: entry}, total_size, wasted_size)

    @property
    def config(self) -> ChunkConfig:
        """The (single) entry of `config_dict` as a `ChunkConfig` (reflecting any edit made to the dict)."""
        (entry,) = self.config_dict.values()
        return ChunkConfig(
            int(entry["chunk_size"]), bool(entry.get("keep_gathered", False)), entry.get("separate_above")
        )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def next_fit_waste(sizes: Sequence[int], chunk_size: int) -> int:
    """Unused elements when `sizes` (each <= chunk_size) are packed next-fit into chunks of `chunk_size`."""
    waste, fill, used = 0, 0, False
    for size in sizes:
        if size > chunk_size:
            raise ValueError(f"next_fit_waste: a tensor of {size} elements exceeds chunk size {chunk_size}")
        if fill + size > chunk_size:
            waste += chunk_size - fill
            fill = 0
        fill += size
        used = True
    return waste + (chunk_size - fill if used else 0)


def _sizes(model_or_params: nn.Module | Iterable[torch.Tensor]) -> list[int]:
    tensors = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    seen: set[int] = set()
    sizes = []
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"search_chunk_configuration: expected tensors, got {type(tensor).__name__}")
        if id(tensor) not in seen:
            seen.add(id(tensor))
            sizes.append(tensor.numel())
    return sizes


def search_chunk_configuration(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    search_range_m: float,
    search_interval: int | None = None,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    *,
    hidden_dim: int | None = None,
    group_size: int = 1,
) -> ChunkSearchResult:
    """Find the chunk size with the least padding waste for these parameters; see the module docstring."""
    if search_range_m < 0 or min_chunk_size_m < 0:
        raise ValueError(
            f"search_chunk_configuration: search_range_m ({search_range_m}) and min_chunk_size_m "
            f"({min_chunk_size_m}) must be >= 0"
        )
    interval = search_interval if search_interval is not None else (hidden_dim if hidden_dim is not None else 1024)
    if interval <= 0 or group_size <= 0:
        raise ValueError(
            f"search_chunk_configuration: search_interval ({interval}) and group_size ({group_size}) must be positive"
        )
    sizes = _sizes(model_or_params)
    if not sizes or sum(sizes) == 0:
        raise ValueError("search_chunk_configuration: no parameters (or only empty ones) to lay out")
    total = sum(sizes)
    min_chunk_size = round(min_chunk_size_m * MEBI)
    if total < min_chunk_size:
        chunk_size = _round_up(total, group_size)
        return ChunkSearchResult.of(ChunkConfig(chunk_size, keep_gathered=True), group_size, total, chunk_size - total)

    threshold: int | None = None
    regular, outliers = list(sizes), []
    if filter_exlarge_params and len(sizes) >= 2:
        mean = total / len(sizes)
        std = math.sqrt(sum((s - mean) ** 2 for s in sizes) / len(sizes))
        threshold = math.floor(mean + 3 * std)
        outliers = [s for s in sizes if s > threshold]
        regular = [s for s in sizes if s <= threshold]
        if not outliers:
            threshold = None
    outlier_waste = sum(_round_up(s, group_size) - s for s in outliers)

    largest = max([min_chunk_size, *regular])
    start = _round_up(max(largest, 1), interval)
    best_size, best_waste = -1, -1
    for candidate in range(start, start + round(search_range_m * MEBI) + 1, interval):
        chunk_size = _round_up(candidate, group_size)
        waste = next_fit_waste(regular, chunk_size) + outlier_waste
        if best_waste < 0 or waste < best_waste or (waste == best_waste and chunk_size < best_size):
            best_size, best_waste = chunk_size, waste
    return ChunkSearchResult.of(ChunkConfig(best_size, separate_above=threshold), group_size, total, best_waste)
