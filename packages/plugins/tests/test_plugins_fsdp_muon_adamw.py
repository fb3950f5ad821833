"""`booster.boost(model, MuonWithAdamW(muon_param_groups(model)))` under TorchFSDPPlugin dp 2 gives one process's
result: the Muon matrices as torch's Muon under FSDP (momentum on each rank's DTensor rows, Newton-Schulz on the whole
matrix at its owner, fsdp/_muon.py), the 3-D expert stacks on each rank's whole experts, and AdamW (embedding,
biases, norm, head) elementwise on the shards (fsdp/_muon_adamw.py). Its checkpoint (no pickle) resumes bit-exactly.

Tolerance as test_plugins_zero_muon_adamw.py: 0.2 of one effective Muon step per matrix (each expert's matrix its own
shape), 0.2 of AdamW's lr per step taken per AdamW parameter (derived in packages/zero/tests/test_zero_low_level_muon.py
and that file's docs; the difference is FSDP's reduce-scattered mean against the reference's full-batch gradient).
Measured in fp32 on CPU: every Muon matrix and stack bit-identical to the reference, the AdamW tensors at most 2e-5 of
their bound; the bound is kept for platforms whose reduction rounds differently.
Rows shard unevenly over two ranks: the embedding and head 11 -> 6 + 5, `down` 5 -> 3 + 2, the expert stacks
3 -> 2 + 1 experts and 1 -> 1 + 0 (rank 1 holds no expert of that stack)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from cx_mesh.testing import distributed
from cx_plugins import Booster, ModelWrapper, TorchFSDPPlugin
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

VOCAB, HIDDEN = 11, 12


class _Experts(nn.Module):
    """Two fused expert stacks (experts, out, in), averaged: 3 experts and a lone one."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Parameter(torch.randn(3, HIDDEN, HIDDEN) / math.sqrt(HIDDEN))
        self.lone = nn.Parameter(torch.randn(1, HIDDEN, HIDDEN) / math.sqrt(HIDDEN))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        stacks = torch.cat([self.stack, self.lone])
        return torch.einsum("bsi,eoi->bso", hidden, stacks) / stacks.shape[0]


class _Tiny(nn.Module):
    """Embedding, hidden matrices with biases, a norm, expert stacks and an output head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.up = nn.Linear(8, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.experts = _Experts()
        self.down = nn.Linear(HIDDEN, 5)
        self.lm_head = nn.Linear(5, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.norm(torch.tanh(self.up(self.embed(tokens))))
        return torch.as_tensor(self.lm_head(torch.tanh(self.down(torch.tanh(self.experts(hidden))))))


def _batch(step: int, world_size: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (PER_RANK * world_size, 4), generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


@distributed(world_size=2)
@pytest.mark.parametrize("wrap", ["per_module", "root"])
def test_plugins_fsdp_muon_adamw_matches_one_process(rank: int, world_size: int, wrap: str, tmp_path: Path) -> None:
    policy = ModuleWrapPolicy({nn.Linear, nn.Embedding, _Experts}) if wrap == "per_module" else None
    booster = Booster(plugin=TorchFSDPPlugin(auto_wrap_policy=policy))
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
    assert sorted(kinds.values()) == [False] * 6 + [True] * 4  # embed, biases, norm, head: AdamW; up, down, stacks
    for (name, mine_p), want in zip(model.unwrap().named_parameters(), reference.named_parameters(), strict=True):
        assert name == want[0]
        bound = muon_bound(MUON_LR, *want[1].shape[-2:]) if kinds[id(want[1])] else ADAMW_BOUND
        torch.testing.assert_close(_full(mine_p), want[1].detach(), rtol=0, atol=bound, msg=name)
    # every state sharded like its parameter (AdamW's step a plain scalar), so checkpoints treat them alike
    for group in optimizer.param_groups:
        names = ("momentum_buffer",) if group["use_muon"] else ("exp_avg", "exp_avg_sq")
        for param in group["params"]:
            state = optimizer.state[param]
            assert sorted(state) == sorted(names if group["use_muon"] else (*names, "step"))
            for key in names:
                assert isinstance(state[key], DTensor), key
                assert state[key].placements == param.placements, key
    # the checkpoint IO's own files (optimizer: safetensors + JSON): a fresh boosted pair resumes bit-exactly
    resumed, resumed_optimizer = save_and_load_fresh(booster, model, optimizer, _Tiny, muon_adamw, tmp_path)
    written = sorted(path.suffix for path in (tmp_path / "optimizer").iterdir())
    assert written == [".json", ".json", ".safetensors"], written  # the optimizer's states: no pickle
    assert isinstance(resumed, ModelWrapper)
    tokens = _batch(STEPS, world_size)
    for boosted_model, boosted_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, _loss(boosted_model, tokens[mine]), boosted_optimizer)
    for (name, p), q in zip(model.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(_full(p), _full(q)), name
