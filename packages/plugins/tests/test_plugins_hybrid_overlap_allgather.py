"""HybridParallelPlugin / MoeHybridParallelPlugin with ZeRO 1 / 2 and `overlap_allgather=True`: the step's updated
shards are still being gathered into the working weights until the next forward, so every read of the weights before
it must wait for them: a save right after `step()` writes this step's weights (it wrote the previous step's, missing
an update of ~7e-3: a silent result), `unwrap().state_dict()` reads them, and a load right after `step()` is not
overwritten by the gathers landing later. Two data-parallel ranks against one process of PyTorch (the plugin
helpers' tolerances: the two differ by the gradient mean's summation order alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import GeneralCheckpointIO
from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, HybridParallelPlugin, MoeHybridParallelPlugin, Plugin
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, LR, assert_matches, data, reference, train


def _plugin(family: str, zero: int) -> Plugin:
    options: dict[str, Any] = dict(tp_size=1, pp_size=1, zero_stage=zero, precision="fp32", overlap_allgather=True)
    return HybridParallelPlugin(**options) if family == "hybrid" else MoeHybridParallelPlugin(ep_size=1, **options)


@distributed(world_size=2)
@pytest.mark.parametrize(("family", "zero"), [("hybrid", 1), ("hybrid", 2), ("moe_hybrid", 2)])
def test_plugins_hybrid_overlap_allgather_reads_right_after_step(
    rank: int, world_size: int, tmp_path: Path, family: str, zero: int
) -> None:
    booster = Booster(plugin=_plugin(family, zero))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    batches = data(2)
    train(rank, world_size, booster, model, optimizer, batches)  # ends with step(): the gathers are in flight
    path = tmp_path / "model"
    booster.save_model(model, path, shard=True)
    saved = GPT(CONFIG, seed=5)
    GeneralCheckpointIO().load_model(saved, path)
    expected = reference(batches)
    assert_matches(saved, expected, "saved right after step")

    train(rank, world_size, booster, model, optimizer, data(1, seed=3))  # in flight again
    assert_matches(model, reference(torch.cat([batches, data(1, seed=3)])), "state_dict right after step")

    if rank == 0:
        GeneralCheckpointIO().save_model(GPT(CONFIG, seed=9), tmp_path / "other.safetensors", use_safetensors=True)
    dist.barrier()
    train(rank, world_size, booster, model, optimizer, data(1, seed=4))  # in flight again
    booster.load_model(model, tmp_path / "other.safetensors")
    assert_matches(model, GPT(CONFIG, seed=9), "loaded right after step")
