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

`group_size` defaults as ColossalAI's dp degree does: the size of `process_group` (the default group when None)
once torch.distributed is initialised, else 1, so `config_dict[world_size]` is the entry on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from cx_chunk._config import ChunkConfig
from cx_chunk._memstats import MemStats

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


def _sizes(model_or_params: nn.Module | Iterable[torch.Tensor], memstats: MemStats | None) -> list[int]:
    """Element counts in packing order: `memstats`' first-use order where it saw the tensors, then the others in the
    given order (shared tensors counted once)."""
    tensors = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"search_chunk_configuration: expected tensors, got {type(tensor).__name__}")
    if memstats is not None:
        given = {id(t) for t in tensors}
        traced = [t for t in memstats.param_order if id(t) in given]
        tensors = traced + tensors
    seen: set[int] = set()
    sizes = []
    for tensor in tensors:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            sizes.append(tensor.numel())
    return sizes


def _group_size(group_size: int | None, process_group: ProcessGroup | None) -> int:
    """The explicit `group_size`, else the process group's size (1 before torch.distributed is initialised)."""
    if process_group is not None and not dist.is_initialized():
        raise ValueError("search_chunk_configuration: process_group given but torch.distributed is not initialised")
    found = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if group_size is None:
        return found
    if process_group is not None and group_size != found:
        raise ValueError(
            f"search_chunk_configuration: group_size={group_size} but process_group has {found} ranks; pass one of them"
        )
    return group_size


def search_chunk_configuration(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    search_range_m: float,
    search_interval: int | None = None,
    min_chunk_size_m: float = 32,
    filter_exlarge_params: bool = True,
    strict_ddp_flag: bool = False,
    process_group: ProcessGroup | None = None,
    memstas: MemStats | None = None,
    *,
    hidden_dim: int | None = None,
    group_size: int | None = None,
) -> ChunkSearchResult:
    """Find the chunk size with the least padding waste for these parameters; see the module docstring.

    ColossalAI's keywords, with its meaning: `process_group` is the group the chunks are sharded over (its size
    keys `config_dict` and divides the chunk size); `memstas` (spelled as ColossalAI spells it) is a `MemStats`
    whose first-use order of the parameters is the packing order (parameters it never saw follow in model order).
    `strict_ddp_flag` is accepted and changes nothing, as in ColossalAI's current search: the result keys by the
    group size either way, and keeping every chunk gathered is `GeminiDDP(strict_ddp_mode=True)`'s job.
    """
    del strict_ddp_flag  # accepted for ColossalAI's call forms; see the docstring
    if search_range_m < 0 or min_chunk_size_m < 0:
        raise ValueError(
            f"search_chunk_configuration: search_range_m ({search_range_m}) and min_chunk_size_m "
            f"({min_chunk_size_m}) must be >= 0"
        )
    interval = search_interval if search_interval is not None else (hidden_dim if hidden_dim is not None else 1024)
    if interval <= 0 or (group_size is not None and group_size <= 0):
        raise ValueError(
            f"search_chunk_configuration: search_interval ({interval}) and group_size ({group_size}) must be positive"
        )
    group_size = _group_size(group_size, process_group)
    sizes = _sizes(model_or_params, memstas)
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
