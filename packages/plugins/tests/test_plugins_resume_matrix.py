"""The cross-plugin resume matrix: save with each plugin at 2 ranks, load with each plugin at 1 and 4 ranks,
continue, and match an uninterrupted single-process run. Every pair uses one of the four file layouts (sharded or
not, safetensors or legacy .bin model files, async or not), so each layout is exercised by several pairs."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch.distributed as dist

from cx_mesh.testing import run_distributed
from plugins_test_helpers import assert_matches, boosted, data, reference, train

PLUGINS = ("torch_ddp", "zero2", "gemini")
LAYOUTS = [  # (shard, use_safetensors, use_async)
    (True, True, False),
    (False, True, True),
    (True, False, True),
    (False, False, False),
]
CASES = [
    (saver, loader, *LAYOUTS[i % len(LAYOUTS)]) for i, (saver, loader) in enumerate(itertools.product(PLUGINS, PLUGINS))
]
STEPS_BEFORE, STEPS_AFTER = 2, 2


def _paths(directory: str, shard: bool, safetensors: bool) -> tuple[Path, Path]:
    model = Path(directory, "model" if shard else ("model.safetensors" if safetensors else "model.bin"))
    optimizer = Path(directory, "optimizer" if shard else "optimizer.safetensors")
    return model, optimizer


def _save(
    rank: int, world_size: int, plugin: str, directory: str, shard: bool, safetensors: bool, use_async: bool
) -> None:
    booster, _, model, optimizer = boosted(plugin)
    train(rank, world_size, booster, model, optimizer, data(STEPS_BEFORE + STEPS_AFTER)[:STEPS_BEFORE])
    model_path, optimizer_path = _paths(directory, shard, safetensors)
    booster.save_model(model, model_path, shard=shard, use_safetensors=safetensors, use_async=use_async)
    booster.save_optimizer(optimizer, optimizer_path, shard=shard, use_async=use_async)
    booster.synchronize()


def _resume(rank: int, world_size: int, plugin: str, directory: str, shard: bool, safetensors: bool) -> None:
    booster, _, model, optimizer = boosted(plugin, seed=1)  # another init: only the checkpoint can fix it
    model_path, optimizer_path = _paths(directory, shard, safetensors)
    booster.load_model(model, model_path)
    booster.load_optimizer(optimizer, optimizer_path)
    batches = data(STEPS_BEFORE + STEPS_AFTER)
    train(rank, world_size, booster, model, optimizer, batches[STEPS_BEFORE:])
    assert_matches(model, reference(batches), f"{plugin} at world {world_size}")
    dist.barrier()


@pytest.mark.parametrize(("saver", "loader", "shard", "safetensors", "use_async"), CASES)
def test_plugins_resume_matrix(
    tmp_path: Path, saver: str, loader: str, shard: bool, safetensors: bool, use_async: bool
) -> None:
    directory = str(tmp_path)
    run_distributed(
        _save, 2, plugin=saver, directory=directory, shard=shard, safetensors=safetensors, use_async=use_async
    )
    for world_size in (1, 4):
        run_distributed(_resume, world_size, plugin=loader, directory=directory, shard=shard, safetensors=safetensors)
