"""`PipelineStageManager`: positions, neighbours, ColossalAI's layer distribution and the V-shaped stage index."""

from __future__ import annotations

import pytest

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import distributed
from cx_pipeline import PipelineConfigError, PipelineStageManager


@distributed(world_size=4)
def test_stage_and_neighbours_on_a_dp_pp_mesh(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("dp", "pp"))
    manager = PipelineStageManager(mesh, "pp")
    assert manager.num_stages == 2
    assert manager.stage == rank % 2
    assert manager.stage_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    other = rank ^ 1
    assert manager.get_next_rank() == other
    assert manager.get_prev_rank() == other
    assert manager.is_first_stage() == (rank % 2 == 0)
    assert manager.is_last_stage() == (rank % 2 == 1)


@distributed(world_size=4)
def test_layer_distribution_and_stage_index(rank: int, world_size: int) -> None:
    mesh = ProcessGroupMesh(4, axis_names=("pp",))
    plain = PipelineStageManager(mesh, "pp")
    assert plain.distribute_layers(10) == [2, 3, 3, 2]  # the remainder goes to the middle stages
    assert plain.distribute_layers(8) == [2, 2, 2, 2]
    assert plain.get_stage_index([2, 3, 3, 2], stage=2) == (5, 8)
    with pytest.raises(PipelineConfigError, match="fewer than the 4 pipeline slots"):
        plain.distribute_layers(3)

    interleaved = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2)
    layers = interleaved.distribute_layers(8)
    assert layers == [1] * 8
    assert interleaved.get_stage_index(layers, stage=1) == [(1, 2), (5, 6)]
    assert interleaved.virtual_stage(1) == 4 + rank

    zbv = PipelineStageManager(mesh, "pp", use_zbv=True, num_model_chunks=2)
    assert zbv.get_stage_index(layers, stage=0) == [(0, 1), (7, 8)]  # the V: stage 0 holds both ends
    assert zbv.get_stage_index(layers, stage=3) == [(3, 4), (4, 5)]
    assert zbv.locate_virtual_stage(7) == (0, 1)
    with zbv.switch_model_chunk_id(0):
        assert zbv.is_first_stage() == (rank == 0)
        assert not zbv.is_last_stage()
    with zbv.switch_model_chunk_id(1):
        assert zbv.is_last_stage() == (rank == 0)
    with pytest.raises(RuntimeError, match="switch_model_chunk_id"):
        zbv.is_first_stage()
    assert zbv.is_first_stage(ignore_chunk=True) == (rank == 0)

    explicit = PipelineStageManager(mesh, "pp", num_layers_per_stage=[1, 2, 3, 4])
    assert explicit.distribute_layers(10) == [1, 2, 3, 4]
    assert explicit.get_stage_index([1, 2, 3, 4]) == [(0, 1), (1, 3), (3, 6), (6, 10)][rank]
