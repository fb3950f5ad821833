"""TorchDDPPlugin checkpoints: save at 2 ranks, resume at 1 and 4, continue exactly as an uninterrupted run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import CheckpointError, KeyMismatchError
from cx_mesh.testing import TEST_ADAM_EPS, distributed, run_distributed, tiny_model_adam_tolerance
from cx_plugins import Booster, OptimizerWrapper, TorchDDPPlugin
from cx_plugins._precision import ScaledOptimizer
from cx_plugins.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, max_positions=8, hidden_size=16, num_layers=1, num_heads=4)
GLOBAL_BATCH, LENGTH, LR = 4, 8, 1e-2
STEPS_BEFORE, STEPS_AFTER = 2, 3
# Resumed and uninterrupted runs differ only in how the global batch is split across ranks (summation order of
# the gradient mean): with AdamW at TEST_ADAM_EPS that is rounding alone (see cx_mesh.testing's tolerances).
ATOL = tiny_model_adam_tolerance(LR, STEPS_BEFORE + STEPS_AFTER, tokens=GLOBAL_BATCH * LENGTH)


def _data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(99)
    shape = (STEPS_BEFORE + STEPS_AFTER, GLOBAL_BATCH, LENGTH)
    return torch.randint(0, CONFIG.vocab_size, shape, generator=generator)


def _train(
    rank: int,
    world_size: int,
    model: torch.nn.Module,
    optimizer: OptimizerWrapper,
    booster: Booster,
    data: torch.Tensor,
) -> None:
    per_rank = GLOBAL_BATCH // world_size
    for batch in data:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()


def _boosted(seed: int) -> tuple[Booster, torch.nn.Module, torch.nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=TorchDDPPlugin())
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    return booster, plain, model, optimizer


def _save_phase(rank: int, world_size: int, directory: str, shard: bool, safetensors: bool, use_async: bool) -> None:
    booster, _, model, optimizer = _boosted(seed=0)
    _train(rank, world_size, model, optimizer, booster, _data()[:STEPS_BEFORE])
    suffix = ".safetensors" if safetensors else ".bin"
    model_path = Path(directory, "model" if shard else f"model{suffix}")
    optimizer_path = Path(directory, "optimizer" if shard else "optimizer.safetensors")
    booster.save_model(model, model_path, shard=shard, use_safetensors=safetensors, use_async=use_async)
    booster.save_optimizer(optimizer, optimizer_path, shard=shard, use_async=use_async)
    booster.synchronize()


def _resume_phase(rank: int, world_size: int, directory: str, shard: bool, safetensors: bool) -> None:
    booster, plain, model, optimizer = _boosted(seed=1)  # different init: only the checkpoint can make it right
    suffix = ".safetensors" if safetensors else ".bin"
    booster.load_model(model, Path(directory, "model" if shard else f"model{suffix}"))
    booster.load_optimizer(optimizer, Path(directory, "optimizer" if shard else "optimizer.safetensors"))
    _train(rank, world_size, model, optimizer, booster, _data()[STEPS_BEFORE:])

    reference = GPT(CONFIG, seed=0)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    for batch in _data():
        reference(batch, labels=batch).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=ATOL, msg=name)
    dist.barrier()


@pytest.mark.parametrize(
    ("shard", "safetensors", "use_async"),
    [(True, True, False), (False, True, True), (False, False, False), (True, False, True)],
)
def test_plugins_ddp_resume_at_other_world_sizes(
    tmp_path: Path, shard: bool, safetensors: bool, use_async: bool
) -> None:
    run_distributed(_save_phase, 2, directory=str(tmp_path), shard=shard, safetensors=safetensors, use_async=use_async)
    for world_size in (1, 4):
        run_distributed(_resume_phase, world_size, directory=str(tmp_path), shard=shard, safetensors=safetensors)


@distributed(world_size=2)
def test_plugins_ddp_checkpoint_errors(rank: int, world_size: int, tmp_path: Path) -> None:
    booster, _, model, _ = _boosted(seed=0)
    with pytest.raises(CheckpointError, match="does not exist"):
        booster.load_model(model, tmp_path / "absent.safetensors")
    path = tmp_path / "model.safetensors"
    booster.save_model(model, path, use_safetensors=True)
    other = GPT(GPTConfig(vocab_size=64, max_positions=8, hidden_size=16, num_layers=2, num_heads=4), seed=0)
    with pytest.raises(KeyMismatchError):
        booster.load_model(other, path)  # strict by default: the extra block's keys are missing from the file


def _fp16_booster() -> tuple[Booster, torch.nn.Module, OptimizerWrapper]:
    booster = Booster(mixed_precision="fp16", plugin=TorchDDPPlugin())
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    return booster, model, optimizer


@distributed(world_size=2)
@pytest.mark.parametrize("shard", [False, True])
def test_plugins_ddp_fp16_checkpoint_keeps_the_loss_scale(
    rank: int, world_size: int, tmp_path: Path, shard: bool
) -> None:
    booster, model, optimizer = _fp16_booster()
    _train(rank, world_size, model, optimizer, booster, _data()[:1])
    assert isinstance(optimizer, ScaledOptimizer)
    optimizer.scaler.update(new_scale=123.0)  # as if overflows had backed the scale off
    path = tmp_path / ("optimizer" if shard else "optimizer.safetensors")
    booster.save_optimizer(optimizer, path, shard=shard)
    resumed_booster, _, resumed = _fp16_booster()
    assert isinstance(resumed, ScaledOptimizer)
    assert resumed.loss_scale != 123.0
    resumed_booster.load_optimizer(resumed, path)
    assert resumed.loss_scale == 123.0
    assert resumed.unwrap().state_dict()["state"], "the Adam moments were restored too"
