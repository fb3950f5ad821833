"""search_chunk_configuration: the chosen size's waste is the brute-force minimum over the same grid; small models
become one gathered chunk; outliers get chunks of their own; the reported waste is what the manager produces."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from cx_chunk import ChunkConfig, ChunkManager, MemStats, search_chunk_configuration
from cx_mesh.testing import distributed

MEBI = 2**20


def _params(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.empty(n, device="meta") for n in sizes]


def _brute_force(sizes: list[int], range_m: float, interval: int, min_m: float, group: int) -> tuple[int, int]:
    """(size, waste) minimising waste over the documented grid, by simulating chunks as explicit lists."""
    mean = sum(sizes) / len(sizes)
    std = math.sqrt(sum((s - mean) ** 2 for s in sizes) / len(sizes))
    cut = math.floor(mean + 3 * std)
    regular = [s for s in sizes if s <= cut]
    outlier_waste = sum((-s) % group for s in sizes if s > cut)
    start = max(round(min_m * MEBI), *regular)
    start = math.ceil(start / interval) * interval
    results = []
    for candidate in range(start, start + round(range_m * MEBI) + 1, interval):
        size = math.ceil(candidate / group) * group
        chunks: list[list[int]] = [[]]
        for s in regular:
            if sum(chunks[-1]) + s > size:
                chunks.append([])
            chunks[-1].append(s)
        results.append((sum(size - sum(c) for c in chunks) + outlier_waste, size))
    waste, size = min(results)
    return size, waste


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=40),
    interval=st.sampled_from([1, 7, 64, 100]),
    group=st.sampled_from([1, 2, 4]),
)
def test_chunk_search_matches_brute_force(sizes: list[int], interval: int, group: int) -> None:
    range_m, min_m = 2000 / MEBI, 500 / MEBI
    if sum(sizes) < round(min_m * MEBI):
        sizes = [*sizes, 600]
    result = search_chunk_configuration(
        _params(sizes), range_m, interval, min_m, filter_exlarge_params=True, group_size=group
    )
    config, total, waste = result.config, result.total_size, result.wasted_size
    size, expected_waste = _brute_force(sizes, range_m, interval, min_m, group)
    assert total == sum(sizes)
    assert waste == expected_waste
    assert config.chunk_size == size
    assert config.chunk_size % group == 0
    assert not config.keep_gathered


def test_chunk_search_small_model_is_one_gathered_chunk() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3))
    config_dict, total, waste = search_chunk_configuration(model, 1, 16, min_chunk_size_m=1, group_size=4)
    assert config_dict == {4: {"chunk_size": 144, "keep_gathered": True}}  # ColossalAI's shape, keyed by group size
    config = search_chunk_configuration(model, 1, 16, min_chunk_size_m=1, group_size=4).config
    assert total == 10 * 10 + 10 + 10 * 3 + 3
    assert config.keep_gathered
    assert config.chunk_size == 144
    assert waste == 144 - total


def test_chunk_search_hidden_dim_sets_default_interval() -> None:
    sizes = [1000, 1000, 24]
    by_hidden = search_chunk_configuration(_params(sizes), 0.01, None, 0, hidden_dim=256)
    explicit = search_chunk_configuration(_params(sizes), 0.01, 256, 0)
    assert by_hidden == explicit
    assert by_hidden.config.chunk_size % 256 == 0


def test_chunk_search_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="no parameters"):
        search_chunk_configuration([], 1, 16)
    with pytest.raises(ValueError, match="search_range_m"):
        search_chunk_configuration(_params([4]), -1, 16)
    with pytest.raises(ValueError, match="search_interval"):
        search_chunk_configuration(_params([4]), 1, 0)


@distributed(world_size=(1, 2))
def test_chunk_search_outliers_get_own_chunks_and_waste_is_real(rank: int, world_size: int) -> None:
    sizes = [300] * 12 + [50_001] + [257, 33] * 5
    result = search_chunk_configuration(_params(sizes), 2000 / MEBI, 32, 100 / MEBI, group_size=world_size)
    config, total, waste = result.config, result.total_size, result.wasted_size
    assert config.separate_above is not None
    assert 300 <= config.separate_above < 50_001
    assert config.chunk_size < 50_001
    manager = ChunkManager(config, compute_device=torch.device("meta"))
    params = _params(sizes)
    for p in params:
        manager.register_tensor(p)
    manager.close_all_groups()
    own = manager.get_chunk(params[12])
    assert own.tensors == [params[12]]
    assert own.chunk_size == -(-50_001 // world_size) * world_size
    actual_waste = sum(c.chunk_size - c.utilized_size for c in manager.chunks())
    assert actual_waste == waste
    assert sum(c.utilized_size for c in manager.chunks()) == total


def test_chunk_search_result_edits_like_colossalai() -> None:
    # ColossalAI's tests: config_dict, *_ = search_chunk_configuration(...); config_dict[world]["chunk_size"] = n
    result = search_chunk_configuration(_params([1000, 1000, 24]), 0.01, 256, 0, group_size=2)
    config_dict, *_ = result
    config_dict[2]["chunk_size"] = 5000
    config_dict[2]["keep_gathered"] = True
    assert result.config == ChunkConfig(5000, keep_gathered=True, separate_above=result.config.separate_above)


@distributed(world_size=2)
def test_chunk_search_keys_by_world_size_as_colossalai_tests_expect(rank: int, world_size: int) -> None:
    # ColossalAI's Gemini tests, verbatim in effect: the entry is keyed by the data-parallel world size
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 40), torch.nn.ReLU(), torch.nn.Linear(40, 8))
    config_dict, *_ = search_chunk_configuration(model, search_range_m=1, search_interval=100)
    config_dict[world_size]["chunk_size"] = 5000
    assert list(config_dict) == [world_size]
    config = ChunkConfig(**config_dict[world_size])
    assert config.chunk_size == 5000
    manager = ChunkManager(config, compute_device=torch.device("cpu"))
    assert manager.group_size == world_size
    for p in model.parameters():
        manager.register_tensor(p.data)
    manager.close_all_groups()
    (chunk,) = manager.chunks()  # 40*40 + 40 + 40*8 + 8 = 1968 elements fit one chunk of the edited size
    assert chunk.chunk_size == 5000
    assert chunk.utilized_size == sum(p.numel() for p in model.parameters())
    # process_group= keys by that group's size; an explicit group_size must agree with it
    singles = [dist.new_group([r]) for r in range(world_size)]
    own = singles[rank]
    assert list(search_chunk_configuration(model, 1, 100, process_group=own).config_dict) == [1]
    assert list(search_chunk_configuration(model, 1, 100, group_size=4).config_dict) == [4]
    with pytest.raises(ValueError, match="group_size=4 but process_group has 1 ranks"):
        search_chunk_configuration(model, 1, 100, process_group=own, group_size=4)


def test_chunk_search_colossalai_keywords() -> None:
    """Outside torch.distributed the group size is 1; strict_ddp_flag changes nothing (as in ColossalAI's search);
    memstas gives the packing order: the same sizes in first-use order pack with different waste."""
    sizes = [600, 500, 500, 600, 600, 500]
    params = _params(sizes)
    plain = search_chunk_configuration(params, 2000 / MEBI, 100, 0)
    assert list(plain.config_dict) == [1]
    assert search_chunk_configuration(params, 2000 / MEBI, 100, 0, strict_ddp_flag=True) == plain
    memstats = MemStats()
    used_first = [params[0], params[3], params[4], params[1]]  # params[2], params[5] never used: they come last
    memstats.record_period(used_first, non_model_bytes=0)
    traced = search_chunk_configuration(params, 2000 / MEBI, 100, 0, memstas=memstats)
    order = [600, 600, 600, 500, 500, 500]
    expected_size, expected_waste = _brute_force(order, 2000 / MEBI, 100, 0, 1)
    assert (traced.config.chunk_size, traced.wasted_size) == (expected_size, expected_waste)
    assert (plain.config.chunk_size, plain.wasted_size) == _brute_force(sizes, 2000 / MEBI, 100, 0, 1)
    assert traced != plain
    with pytest.raises(ValueError, match=r"process_group given but torch\.distributed is not initialised"):
        search_chunk_configuration(params, 1, 100, process_group=object())  # type: ignore[arg-type]
