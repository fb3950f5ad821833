"""Shared pieces of the trainer's checkpoint and option tests: a tiny GPT, deterministic data, a plugin by name, and
plain data-parallel training of it."""

from __future__ import annotations

import torch
from torch import nn

from cx_plugins import Booster, GeminiPlugin, OptimizerWrapper, Plugin, TorchDDPPlugin
from cx_plugins.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, max_positions=8, hidden_size=16, num_layers=1, num_heads=4)
GLOBAL_BATCH, LENGTH, LR = 4, 8, 1e-2


def data(steps: int, seed: int = 99) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CONFIG.vocab_size, (steps, GLOBAL_BATCH, LENGTH), generator=generator)


def make_plugin(name: str) -> Plugin:
    if name == "torch_ddp":
        return TorchDDPPlugin()
    if name == "gemini":  # small chunks, so the tiny model really is sharded over several chunks
        return GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 1024})
    raise ValueError(name)


def boosted(plugin: str, seed: int = 0) -> tuple[Booster, nn.Module, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=make_plugin(plugin))
    plain = GPT(CONFIG, seed=seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    return booster, plain, model, optimizer


def train(
    rank: int, world_size: int, booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, batches: torch.Tensor
) -> list[float]:
    per_rank = GLOBAL_BATCH // world_size
    losses = []
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses
