"""HybridParallelPlugin and MoeHybridParallelPlugin refuse to load optimizer state saved by another optimizer class,
at load time with GeneralCheckpointIO's `CheckpointKindError`, instead of accepting it and failing in the first
`step()` with a bare `KeyError: 'momentum'` (AdamW's state in SGD with momentum, or the reverse)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from cx_checkpoint import CheckpointKind, CheckpointKindError, CheckpointReader, read_optimizer_meta
from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelPlugin, MoeHybridParallelPlugin, OptimizerWrapper, Plugin
from hybrid_test_helpers import llama
from moe_hybrid_test_helpers import mixtral

_ADAMW, _SGD = "torch.optim.adamw.AdamW", "torch.optim.sgd.SGD"


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)


def _trained(
    booster: Booster, build: Callable[[], nn.Module], make: Callable[[nn.Module], torch.optim.Optimizer]
) -> tuple[nn.Module, OptimizerWrapper]:
    model = build()
    boosted, optimizer, *_ = booster.boost(model, make(model))
    assert optimizer is not None
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(0))
    booster.backward(boosted(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()  # the state (AdamW's moments, SGD's momentum buffers) exists
    optimizer.zero_grad()
    return boosted, optimizer


def _refused_across_classes(
    tmp_path: Path,
    plugin: Plugin,
    build: Callable[[], nn.Module],
    saved: Callable[[nn.Module], torch.optim.Optimizer],
    loaded: Callable[[nn.Module], torch.optim.Optimizer],
    names: tuple[str, str],
) -> None:
    booster = Booster(plugin=plugin)
    _, optimizer = _trained(booster, build, saved)
    directory = tmp_path / "optimizer"
    booster.save_optimizer(optimizer, directory, shard=True)
    torch.distributed.barrier()
    with CheckpointReader.open(directory, CheckpointKind.OPTIMIZER) as reader:
        assert read_optimizer_meta(reader).optimizer_class == names[0]
    _, other = _trained(booster, build, loaded)
    with pytest.raises(CheckpointKindError, match=f"saved by {names[0]}, loading into {names[1]}"):
        booster.load_optimizer(other, directory)
    _, same = _trained(booster, build, saved)
    booster.load_optimizer(same, directory)  # the same class still loads
    same.step()


@distributed(world_size=2)
def test_plugins_hybrid_refuses_state_of_another_optimizer_class(rank: int, world_size: int, tmp_path: Path) -> None:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    _refused_across_classes(tmp_path, plugin, lambda: llama(layers=1), _adamw, _sgd, (_ADAMW, _SGD))


@distributed(world_size=2)
def test_plugins_moe_hybrid_refuses_state_of_another_optimizer_class(
    rank: int, world_size: int, tmp_path: Path
) -> None:
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32")
    _refused_across_classes(tmp_path, plugin, lambda: mixtral(layers=1), _sgd, _adamw, (_SGD, _ADAMW))
