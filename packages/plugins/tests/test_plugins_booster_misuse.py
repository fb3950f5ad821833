"""What the Booster says instead of staying silent or failing deep inside a plugin: boosting twice, backward before
boost, load_model(strict=False) skipping keys, position-keyed optimizer checkpoints where names are needed, and a
NaN loss in bf16 (stopped with an error naming the step, on every rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cx_checkpoint import CheckpointKindError, GeneralCheckpointIO
from cx_mesh.testing import distributed
from cx_plugins import Booster
from cx_plugins.models import GPT, GPTConfig
from plugins_test_helpers import CONFIG, GLOBAL_BATCH, boosted, data, full_state, make_plugin


@distributed(world_size=1)
@pytest.mark.parametrize("plugin", ["torch_ddp", "gemini", "zero2"])
def test_plugins_boosting_twice_and_backward_before_boost(rank: int, world_size: int, plugin: str) -> None:
    booster = Booster(plugin=make_plugin(plugin))
    plain = GPT(CONFIG, seed=0)
    torch_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    batch = data(1)[0]
    with pytest.raises(TypeError, match=r"needs the optimizer booster.boost returned, got a torch.optim.adamw.AdamW"):
        booster.backward(plain(batch, labels=batch), torch_optimizer)  # type: ignore[arg-type]
    model, optimizer, *_ = booster.boost(plain, torch_optimizer)
    assert optimizer is not None
    with pytest.raises(ValueError, match="the optimizer is already boosted"):
        booster.boost(model, optimizer)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="this AdamW was already boosted"):
        booster.boost(model, torch_optimizer)
    with pytest.raises(ValueError, match="this GPT was already boosted"):
        Booster(plugin=make_plugin(plugin)).boost(plain)
    loss = model(batch, labels=batch)
    booster.backward(loss, optimizer)  # the boosted pair still trains
    optimizer.step()


@distributed(world_size=1)
def test_plugins_load_model_not_strict_reports_skipped_keys(rank: int, world_size: int, tmp_path: Path) -> None:
    booster, plain, model, _ = boosted("torch_ddp")
    smaller = GPT(GPTConfig(vocab_size=64, max_positions=8, hidden_size=16, num_layers=2, num_heads=4), seed=3)
    GeneralCheckpointIO().save_model(smaller, tmp_path / "two_layers.safetensors", use_safetensors=True)
    with pytest.warns(UserWarning, match=r"0 key\(s\) of the model were not in the checkpoint.*\d+ key\(s\) of the "):
        result = booster.load_model(model, tmp_path / "two_layers.safetensors", strict=False)
    assert result.missing_keys == ()
    assert result.unexpected_keys
    assert all(key.startswith("blocks.1.") for key in result.unexpected_keys)
    result = booster.load_model(model, tmp_path / "two_layers.safetensors", strict=False, verify=True)
    assert torch.equal(
        plain.state_dict()["blocks.0.attention.qkv.weight"], smaller.state_dict()["blocks.0.attention.qkv.weight"]
    )


@distributed(world_size=1)
@pytest.mark.parametrize("plugin", ["gemini", "zero2"])
def test_plugins_position_keyed_optimizer_refused_by_name_keyed_plugins(
    rank: int, world_size: int, tmp_path: Path, plugin: str
) -> None:
    plain = GPT(CONFIG, seed=0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)  # no names: saved keyed by position
    batch = data(1)[0]
    plain(batch, labels=batch).backward()
    optimizer.step()
    GeneralCheckpointIO().save_optimizer(optimizer, tmp_path / "optim", shard=True)
    booster, _, _, boosted_optimizer = boosted(plugin)
    with pytest.raises(CheckpointKindError, match="keyed by parameter POSITION"):
        booster.load_optimizer(boosted_optimizer, tmp_path / "optim")
    # the DDP plugin keeps the same layout: it loads by position
    ddp_booster, _, _, ddp_optimizer = boosted("torch_ddp")
    ddp_booster.load_optimizer(ddp_optimizer, tmp_path / "optim")
    assert torch.equal(
        ddp_optimizer.unwrap().state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "gemini", "zero2"])
def test_plugins_bf16_nan_loss_stops_every_rank_naming_the_step(rank: int, world_size: int, plugin: str) -> None:
    if plugin == "torch_ddp":
        booster = Booster(plugin=make_plugin(plugin), mixed_precision="bf16")
    else:
        booster = Booster(plugin=make_plugin(plugin, precision="bf16"))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    assert optimizer is not None
    per_rank = GLOBAL_BATCH // world_size
    for step, batch in enumerate(data(3), start=1):
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        if step == 3 and rank == 1:
            loss = loss * float("nan")
        if step == 3:
            with pytest.raises(FloatingPointError, match=r"not finite on rank\(s\) \[1\].* at optimizer step 3"):
                booster.backward(loss, optimizer)
            break
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    state = full_state(model)  # gathered for Gemini (collective)
    assert all(torch.isfinite(value.float()).all() for value in state.values()), "no parameter became NaN"
