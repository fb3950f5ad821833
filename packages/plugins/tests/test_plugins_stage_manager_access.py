"""`booster.plugin.stage_manager`, as ColossalAI scripts read it (`if booster.plugin.stage_manager.is_last_stage():
print(loss)`): the hybrid plugins' PipelineStageManager with pp_size > 1, None with pp_size 1 (as in ColossalAI)."""

from __future__ import annotations

from cx_mesh.testing import distributed
from cx_pipeline import PipelineStageManager
from cx_plugins import Booster, HybridParallelPlugin, MoeHybridParallelPlugin


@distributed(world_size=2)
def test_plugin_stage_manager(rank: int, world_size: int) -> None:
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32"))
    manager = getattr(booster.plugin, "stage_manager", None)
    assert isinstance(manager, PipelineStageManager)
    assert (manager.is_first_stage(), manager.is_last_stage(), manager.num_stages) == (rank == 0, rank == 1, 2)
    moe = MoeHybridParallelPlugin(tp_size=1, pp_size=2, ep_size=1, num_microbatches=2, precision="fp32")
    assert moe.stage_manager is not None
    assert moe.stage_manager.is_last_stage() == (rank == 1)
    assert HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32").stage_manager is None
