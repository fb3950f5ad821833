"""A pipeline-split boosted model lists, in `parameters()` / `named_parameters()` / `buffers()`, only what this rank
holds, as ColossalAI's does: other stages' parameters are meta placeholders (kept for names and shapes in `unwrap()`),
and a script comparing two boosted models parameter by parameter (ColossalAI's `test_moe_checkpoint` does, with
`torch.allclose`) met "Tensor.item() cannot be called on meta tensors"."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins.models import GPT, GPTConfig
from plugins_test_helpers import LR

CONFIG = GPTConfig(vocab_size=64, max_positions=8, hidden_size=16, num_layers=2, num_heads=4)


def _boosted(booster: Booster, seed: int) -> HybridParallelModule:
    plain = GPT(CONFIG, seed=seed)
    model, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert isinstance(model, HybridParallelModule)
    return model


@distributed(world_size=2)
def test_plugins_hybrid_boosted_model_lists_the_held_parameters(rank: int, world_size: int, tmp_path: Path) -> None:
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32"))
    model = _boosted(booster, seed=0)
    listed = {name.removeprefix("module."): p for name, p in model.named_parameters()}
    assert set(listed) == set(model.held_parameter_names()), "parameters() lists exactly this stage's"
    assert not any(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())
    everyone: list[list[str]] = [[] for _ in range(world_size)]
    dist.all_gather_object(everyone, sorted(listed))
    whole = {name for name, _ in GPT(CONFIG, seed=0).named_parameters()}
    assert set().union(*map(set, everyone)) == whole, "the stages' lists together are the whole model"
    assert {name for name, _ in model.unwrap().named_parameters()} == whole, "unwrap() keeps every name"

    booster.save_model(model, tmp_path / "model", shard=True)
    other = _boosted(booster, seed=3)
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))
    booster.load_model(other, tmp_path / "model")
    for (name, saved), loaded in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.allclose(saved, loaded, rtol=0, atol=0), f"{name} differs after the load"
