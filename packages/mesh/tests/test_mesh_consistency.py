"""assert_same_across_ranks: silent when ranks agree, a clear error on every rank naming who differs."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist

from cx_mesh import ProcessGroupMesh, RankMismatchError, all_gather_bytes, assert_same_across_ranks
from cx_mesh.testing import distributed


@distributed(world_size=4)
def test_consistency_agreeing_ranks_pass(rank: int, world_size: int) -> None:
    assert_same_across_ranks({"tp": 2, "precision": "bf16"}, what="plugin config")


@distributed(world_size=4)
def test_consistency_planted_disagreement_raises_everywhere(rank: int, world_size: int) -> None:
    value = {"tp_size": 4 if rank == 2 else 2}
    with pytest.raises(RankMismatchError) as caught:
        assert_same_across_ranks(value, what="tp_size")
    message = str(caught.value)
    assert "ranks disagree on tp_size" in message
    assert "ranks [2] differ from ranks [0, 1, 3]" in message
    assert "tp_size: ranks [0, 1, 3]: 2; ranks [2]: 4" in message


@dataclasses.dataclass(frozen=True)
class _Precision:
    dtype: str
    initial_scale: float


@dataclasses.dataclass(frozen=True)
class _Settings:
    plugin: str
    precision: _Precision
    groups: tuple[dict[str, float], ...]
    padding: str


@distributed(world_size=2)
def test_consistency_error_names_only_the_differing_fields(rank: int, world_size: int) -> None:
    settings = _Settings(
        plugin="GeminiPlugin",
        precision=_Precision("bf16" if rank == 0 else "fp16", 2.0**16),
        groups=({"lr": 1e-3, "weight_decay": 0.0}, {"lr": 1e-3 if rank == 0 else 2e-3, "weight_decay": 0.1}),
        padding="x" * 500,  # long fields that agree are not shown at all
    )
    with pytest.raises(RankMismatchError) as caught:
        assert_same_across_ranks(settings, what="settings")
    lines = str(caught.value).splitlines()
    assert lines[1:] == [
        "  precision.dtype: ranks [0]: 'bf16'; ranks [1]: 'fp16'",
        "  groups[1]['lr']: ranks [0]: 0.001; ranks [1]: 0.002",
    ]


@distributed(world_size=4)
def test_consistency_within_a_subgroup_names_global_ranks(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2)
    group = mesh.get_group_along_axis(0)  # ranks {0, 2} and {1, 3}
    value = rank if rank in (1, 3) else 0  # ranks 0 and 2 agree; 1 and 3 differ
    if rank in (0, 2):
        assert_same_across_ranks(value, group, what="seed")
    else:
        with pytest.raises(RankMismatchError, match=r"ranks disagree on seed"):
            assert_same_across_ranks(value, group, what="seed")
    mesh.destroy_mesh_process_groups()


@distributed(world_size=2)
def test_consistency_all_gather_bytes_variable_lengths(rank: int, world_size: int) -> None:
    payloads = [b"", b"hello world"]
    assert all_gather_bytes(payloads[rank]) == payloads
    assert dist.get_world_size() == world_size
