"""`prefix=""` through the Booster is no prefix, as in ColossalAI's `add_prefix`: `save_model(..., shard=True,
prefix="")`, `save_optimizer(..., prefix="")` and `load_optimizer(o, path, "")` (ColossalAI's positional order) write
and read the same files as no prefix, with every plugin's checkpoint IO."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_checkpoint import CheckpointKind, CheckpointReader
from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelPlugin, OptimizerWrapper, Plugin
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, GLOBAL_BATCH, data, make_plugin


def _plugin(name: str) -> Plugin:
    if name == "hybrid_tp2":
        return HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    return make_plugin(name)


def _boosted(name: str, seed: int) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=_plugin(name))
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    assert optimizer is not None
    return booster, model, optimizer


def _tensors(path: Path, kind: CheckpointKind) -> dict[str, torch.Tensor]:
    with CheckpointReader.open(path, kind) as reader:
        return {name: reader.read(name).clone() for name in reader.names()}


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "zero2", "gemini", "hybrid_tp2"])
def test_empty_prefix_saves_and_loads_like_no_prefix(rank: int, world_size: int, plugin: str, tmp_path: Path) -> None:
    booster, model, optimizer = _boosted(plugin, seed=0)
    batch = data(1)[0]
    mine = batch if plugin == "hybrid_tp2" else batch[rank * GLOBAL_BATCH // 2 : (rank + 1) * GLOBAL_BATCH // 2]
    booster.backward(model(mine, labels=mine), optimizer)
    optimizer.step()
    empty, none = tmp_path / "empty", tmp_path / "none"
    booster.save_model(model, empty, shard=True, prefix="")
    booster.save_optimizer(optimizer, empty, shard=True, prefix="")
    dist.barrier()

    booster, other, other_optimizer = _boosted(plugin, seed=1)  # another init: only the checkpoint can make it right
    booster.load_model(other, empty)
    booster.load_optimizer(other_optimizer, empty, "")
    booster.save_model(other, none, shard=True)
    booster.save_optimizer(other_optimizer, none, shard=True)
    dist.barrier()

    names = sorted(p.name for p in empty.iterdir())
    assert names == sorted(p.name for p in none.iterdir())
    assert not any(name.startswith("-") for name in names), names
    for kind in (CheckpointKind.MODEL, CheckpointKind.OPTIMIZER):
        saved, resaved = _tensors(empty, kind), _tensors(none, kind)
        assert set(saved) == set(resaved), kind
        for name, value in saved.items():
            torch.testing.assert_close(resaved[name], value, rtol=0, atol=0, msg=f"{kind.value} {name}")
