"""The model both pipeline benchmarks run (`bench_pipeline`'s schedules, `bench_actions`' per-action costs): a
GPT-like decoder split by layer into stage bodies, its sizes, and its loss. A module of its own so that the two
scripts import it, not each other. `CX_BENCH_SMOKE=1` shrinks it for a seconds-long check.

Scripts import it by name: Python puts the running script's folder (benchmarks/pipeline) on `sys.path`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["HEADS", "HIDDEN", "MICRO", "SEQ", "VOCAB", "Block", "StageBody", "lm_loss"]

HIDDEN, HEADS, VOCAB, SEQ, MICRO = 128, 4, 1024, 64, 4
if os.environ.get("CX_BENCH_SMOKE"):
    HIDDEN, VOCAB, SEQ, MICRO = 32, 64, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        out: torch.Tensor = x + self.proj(F.gelu(self.fc(self.ln_2(x))))
        return out


class StageBody(nn.Module):
    """Layers of one virtual stage, tensor in, tensor out (what torch's PipelineStage runs)."""

    def __init__(self, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if first else None
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over the whole vocabulary."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
