"""`optimizer_states_dtype="bf16"` through the Booster: the saved moments are bf16 (safetensors), a resume is exact
(the rounding bits depend on the step, not on generator state), a bf16 checkpoint loads into fp32 states, and the
unsupported combinations are refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, HybridParallelPlugin, LowLevelZeroPlugin, OptimizerWrapper, Plugin
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, LR, data, full_state, make_plugin, train

SAVE_AT, STEPS = 2, 4


def _plugin(name: str, **options: Any) -> Plugin:
    if name == "hybrid_zero1":
        return HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=1, precision="fp32", **options)
    return make_plugin(name, **options)


def _boost(name: str, seed: int, **options: Any) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=_plugin(name, **options))
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    return booster, model, optimizer


def _moment_dtypes(directory: Path) -> set[torch.dtype]:
    tensors: dict[str, torch.Tensor] = {}
    for path in directory.rglob("*.safetensors"):
        tensors.update(load_file(path))
    return {value.dtype for key, value in tensors.items() if "exp_avg" in key}


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["zero2", "gemini", "hybrid_zero1"])
def test_plugins_bf16_states_save_resume_and_load_into_fp32(
    rank: int, world_size: int, plugin: str, tmp_path: Path
) -> None:
    if plugin == "zero2":  # the refusals, once
        with pytest.raises(ValueError, match="optimizer_states_dtype must be one of"):
            LowLevelZeroPlugin(optimizer_states_dtype="fp16")
        with pytest.raises(ValueError, match="zero_stage 1 or 2"):
            HybridParallelPlugin(tp_size=1, pp_size=1, zero_stage=0, optimizer_states_dtype="bf16")
    batches = data(STEPS)
    booster, model, optimizer = _boost(plugin, seed=0, optimizer_states_dtype="bf16")
    train(rank, world_size, booster, model, optimizer, batches[:SAVE_AT])
    booster.save_model(model, tmp_path / "model", shard=True, use_safetensors=True)
    booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)
    assert _moment_dtypes(tmp_path / "optimizer") == {torch.bfloat16}

    resumed_booster, resumed_model, resumed = _boost(plugin, seed=1, optimizer_states_dtype="bf16")
    resumed_booster.load_model(resumed_model, tmp_path / "model")
    resumed_booster.load_optimizer(resumed, tmp_path / "optimizer")
    straight = train(rank, world_size, booster, model, optimizer, batches[SAVE_AT:])
    again = train(rank, world_size, resumed_booster, resumed_model, resumed, batches[SAVE_AT:])
    assert again == straight
    want = full_state(model)
    for name, value in full_state(resumed_model).items():
        assert torch.equal(value, want[name]), f"{plugin}: {name} differs after resuming bf16 states"

    # bf16 moments into a run with fp32 states: cast exactly, and training goes on
    fp32_booster, fp32_model, fp32_optimizer = _boost(plugin, seed=1)
    fp32_booster.load_model(fp32_model, tmp_path / "model")
    fp32_booster.load_optimizer(fp32_optimizer, tmp_path / "optimizer")
    fp32_booster.save_optimizer(fp32_optimizer, tmp_path / "as_fp32", shard=True)
    assert _moment_dtypes(tmp_path / "as_fp32") == {torch.float32}
    losses = train(rank, world_size, fp32_booster, fp32_model, fp32_optimizer, batches[SAVE_AT:])
    assert losses[0] == straight[0], "the same weights give the same first loss"
