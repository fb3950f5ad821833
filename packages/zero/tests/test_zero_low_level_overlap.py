"""`overlap_allgather=True` on the lazy path: no `synchronize_working_params()` between steps, so each forward after a
step is the first to read the freshly gathered parameters. Models whose forward reads a parameter of a submodule it
never calls (`nn.MultiheadAttention` reads `out_proj.weight` through functional code) must see the updated values.

Small buckets put those parameters in other buckets than the calling module's own. Every step's loss is compared
with a single-process reference before the backward (a stale weight shows there first), and the parameters at the
end; fp32, world 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer
from zero_test_helpers import Reference, assert_params_close, average, clone_model, local

RTOL, ATOL = 1e-5, 1e-6
STEPS, DIM, SEQ, PER_RANK, VOCAB = 4, 8, 5, 2, 17


class AttentionNet(nn.Module):
    """Linear -> nn.MultiheadAttention -> Linear: the attention module never calls its `out_proj`."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        out: torch.Tensor = self.out(self.attn(h, h, h, need_weights=False)[0])
        return out


class EncoderNet(nn.Module):
    """One `nn.TransformerEncoderLayer` (its self-attention reads `out_proj.weight` directly) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layer(x))
        return out


class HFLogits(nn.Module):
    """A tiny Hugging Face GPT-2 from a config (no download); returns the logits."""

    def __init__(self) -> None:
        super().__init__()
        transformers: Any = pytest.importorskip("transformers")
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits
        return logits


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return {"mha": AttentionNet, "encoder": EncoderNet, "hf": HFLogits}[kind]()


def _batch(kind: str, step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    n = world_size * PER_RANK
    if kind == "hf":
        tokens = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return tokens, tokens.roll(-1, dims=1)
    return torch.randn(n, SEQ, DIM, generator=g), torch.randn(n, SEQ, DIM, generator=g)


def _loss_fn(kind: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    def compute(model: nn.Module) -> torch.Tensor:
        out: torch.Tensor = model(x)
        if kind == "hf":
            return nn.functional.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))
        return ((out - y) ** 2).mean()

    return compute


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "stage"), [("mha", 1), ("mha", 2), ("encoder", 2), ("hf", 2)])
def test_zero_overlap_allgather_lazy_path_matches_reference(rank: int, world_size: int, kind: str, stage: int) -> None:
    model = _model(kind)
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        overlap_allgather=True,
        reduce_bucket_size=64,  # out_proj.weight (64 elements) and in_proj_weight (192) land in other buckets
    )
    assert len({id(b) for g in optimizer._gatherers for b in g.buckets}) > 3, "the parameters must span buckets"
    for step in range(STEPS):
        x, y = _batch(kind, step, world_size)
        loss_fn = _loss_fn(kind, local(x, rank, world_size), local(y, rank, world_size))
        with torch.no_grad():
            expected = loss_fn(reference.model)
        optimizer.zero_grad()
        loss = loss_fn(model)  # the first read of the parameters gathered lazily after the previous step
        torch.testing.assert_close(loss.detach(), expected, rtol=RTOL, atol=ATOL, msg=f"{kind}: loss at step {step}")
        optimizer.backward(loss)
        optimizer.step()
        per_rank = [
            reference.grads_of(_loss_fn(kind, local(x, r, world_size), local(y, r, world_size)))
            for r in range(world_size)
        ]
        reference.step(average(per_rank, 1.0 / world_size))
    optimizer.synchronize_working_params()
    assert_params_close(model, reference.model, RTOL, ATOL, f"{kind} after {STEPS} steps")
