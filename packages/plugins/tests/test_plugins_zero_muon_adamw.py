"""`booster.boost(model, MuonWithAdamW(muon_param_groups(model)))` under LowLevelZeroPlugin stage 1 and 2 and
GeminiPlugin (dp 2) gives one process's result (Muon on the hidden matrices, each stepped whole on one owner rank,
cx_zero's `_whole_step` / Gemini's `_whole`; AdamW on the embedding, biases, norm and head: on LowLevelZero's flat
shards, whole on owners under Gemini), and its checkpoint resumes bit-exactly.

Tolerance. Muon matrices: 0.2 of one effective step lr * sqrt(max(1, rows / cols)), derived in
packages/zero/tests/test_zero_low_level_muon.py (the data-parallel sum's rounding, about 1e-7 relative, rarely flips a
bf16 rounding of Newton-Schulz's input, which moves a matrix visibly but boundedly). AdamW parameters: AdamW alone is
elementwise and would differ by about 1e-7 relative, but a flipped Muon matrix changes the gradients that reach
them; Adam's step lr * m_hat / (sqrt(v_hat) + eps) is at most about lr per element at these few steps, and the
gradient change from a 0.2-step Muon difference moves it by a fraction of that, so the same 0.2 of one step (lr) per
step taken is the bound. Slice-wise orthogonalisation (what whole stepping avoids) is off by 0.19 to 0.54 of an
effective step in a single step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, GeminiPlugin, LowLevelZeroPlugin, ModelWrapper, Plugin
from muon_test_helpers import (
    ADAMW_BOUND,
    MUON_LR,
    PER_RANK,
    STEPS,
    boosted_step,
    muon_adamw,
    muon_bound,
    rank_rows,
    reference_step,
    save_and_load_fresh,
)
from plugins_test_helpers import full_state

VOCAB = 11


class _Tiny(nn.Module):
    """Embedding, hidden matrices with biases straddling the two ranks' flat shards, a norm and an output head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.up = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, 5)
        self.lm_head = nn.Linear(5, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.down(self.norm(torch.tanh(self.up(self.embed(tokens))))))
        return torch.as_tensor(self.lm_head(hidden))


def _batch(step: int, world_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (PER_RANK * world_size, 4), generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def _plugin(name: str) -> Plugin:
    if name == "gemini":  # 64-element chunks: the matrices straddle the two ranks' shards
        return GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 64})
    return LowLevelZeroPlugin(stage=int(name[-1]), precision="fp32")


@distributed(world_size=2)
@pytest.mark.parametrize("name", ["zero1", "zero2", "gemini"])
def test_plugins_zero_muon_adamw_matches_one_process(rank: int, world_size: int, name: str, tmp_path: Path) -> None:
    booster = Booster(plugin=_plugin(name))
    plain = _Tiny()
    model, optimizer, *_ = booster.boost(plain, muon_adamw(plain))
    assert isinstance(model, ModelWrapper)
    assert optimizer is not None
    reference = _Tiny()
    reference_optimizer = muon_adamw(reference)
    mine = rank_rows(rank)
    for step in range(STEPS):
        tokens = _batch(step, world_size)
        boosted_step(booster, _loss(model, tokens[mine]), optimizer)
        reference_step(_loss(reference, tokens), reference_optimizer)
    kinds = {id(p): g["use_muon"] for g in reference_optimizer.param_groups for p in g["params"]}
    assert sorted(kinds.values()) == [False] * 6 + [True] * 2  # embed, biases, norm, head: AdamW; up, down: Muon
    state = full_state(model)
    for key, want in reference.named_parameters():
        bound = muon_bound(MUON_LR, *want.shape) if kinds[id(want)] else ADAMW_BOUND
        torch.testing.assert_close(state[key], want.detach(), rtol=0, atol=bound, msg=key)
    # the checkpoint IO's own files (no pickle): a fresh boosted pair resumes bit-exactly
    resumed, resumed_optimizer = save_and_load_fresh(booster, model, optimizer, _Tiny, muon_adamw, tmp_path)
    assert isinstance(resumed, ModelWrapper)
    tokens = _batch(STEPS, world_size)
    for boosted_model, boosted_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, _loss(boosted_model, tokens[mine]), boosted_optimizer)
    resumed_state = full_state(resumed)
    for key, value in full_state(model).items():
        assert torch.equal(value, resumed_state[key]), key
