"""A tiny Hugging Face GPT-2 (built from a config, no download) trains under every plugin exactly like
single-process PyTorch: no model-specific code anywhere in cx. Skipped when transformers is not installed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster
from plugins_test_helpers import ATOL, RTOL, full_state, make_plugin

transformers = pytest.importorskip("transformers")

STEPS, GLOBAL_BATCH, LENGTH, LR = 3, 4, 8, 1e-2


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def _batches() -> torch.Tensor:
    return torch.randint(0, 64, (STEPS, GLOBAL_BATCH, LENGTH), generator=torch.Generator().manual_seed(5))


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "zero2", "gemini"])
def test_plugins_transformers_gpt2(rank: int, world_size: int, plugin: str) -> None:
    model = _gpt2()
    expected = copy.deepcopy(model)
    booster = Booster(plugin=make_plugin(plugin))
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    reference_optimizer = torch.optim.AdamW(expected.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    per_rank = GLOBAL_BATCH // world_size
    for batch in _batches():
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(boosted(input_ids=mine, labels=mine).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        expected(input_ids=batch, labels=batch).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    state = full_state(boosted)
    for name, value in expected.state_dict().items():
        torch.testing.assert_close(state[name].float(), value, rtol=RTOL, atol=ATOL, msg=name)
