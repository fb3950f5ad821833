"""A boosted model and optimizer are freed once the user drops them: nothing a plugin or engine keeps (checkpoint-IO
lookups, gradient hooks that live in C++ out of the garbage collector's sight) holds them, so a long-lived plugin
or a sweep that boosts model after model does not pile them up."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelPlugin, Plugin, TorchFSDPPlugin
from cx_plugins.models import GPT
from plugins_test_helpers import CONFIG, data, make_plugin


def _plugin(name: str) -> Plugin:
    if name.startswith("hybrid"):
        return HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32", zero_stage=int(name[-1]))
    if name == "fsdp":
        return TorchFSDPPlugin()
    return make_plugin(name)


@distributed(world_size=1)
@pytest.mark.parametrize("name", ["torch_ddp", "fsdp", "gemini", "zero1", "zero2", "hybrid_zero0", "hybrid_zero1"])
def test_plugins_release_what_the_user_dropped(rank: int, world_size: int, name: str) -> None:
    booster = Booster(plugin=_plugin(name))
    plain = GPT(CONFIG, seed=0)
    raw = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    model, optimizer, *rest = booster.boost(plain, raw)
    assert optimizer is not None
    batch = data(1)[0]
    booster.backward(model(batch, labels=batch), optimizer)
    optimizer.step()
    watched: dict[str, weakref.ref[Any]] = {
        "the user's model": weakref.ref(plain),
        "the user's optimizer": weakref.ref(raw),
        "the boosted model": weakref.ref(model),
        "the boosted optimizer": weakref.ref(optimizer),
    }
    del plain, raw, model, optimizer, rest, batch
    gc.collect()
    alive = [what for what, ref in watched.items() if ref() is not None]
    assert not alive, f"{type(booster.plugin).__name__} keeps {alive} alive after the user dropped them"
    booster.plugin.get_checkpoint_io()  # the plugin itself is still usable
