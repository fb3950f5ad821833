"""Shared pieces of the Gemini tests: a small GPT with tied embeddings, deterministic data, the PyTorch reference.

The reference is what data parallelism computes, in one process: each rank's micro-batch gradient is computed
separately (same ops, same dtype as the rank computes with) and the gradients are averaged in fp32; the optimizer
then steps fp32 master copies, which are cast back into the model's dtype for the next forward.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, SEQ, MICRO = 64, 16, 2, 8, 2


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        # no bias: the key bias has an exactly-zero gradient (softmax is shift invariant), pure rounding noise that
        # Adam would amplify to +-lr, making any two summation orders disagree
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: torch.Tensor = self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out


class GPT(nn.Module):
    """GPT-2 in miniature: token + position embeddings, pre-LN blocks, final LN, LM head tied to the embedding."""

    pos: torch.Tensor

    def __init__(self, layers: int = 2, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(SEQ, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(self.pos[: tokens.shape[1]])
        for block in self.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def make_gpt(seed: int = 0, layers: int = 2) -> GPT:
    torch.manual_seed(seed)
    return GPT(layers)


def batch(step: int, world_size: int, micro: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: `world_size * micro` sequences (rank r takes rows [r*micro, (r+1)*micro))."""
    gen = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (world_size * micro, SEQ + 1), generator=gen)
    return data[:, :-1], data[:, 1:]


def local(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = tensor.shape[0] // world_size
    return tensor[rank * per : (rank + 1) * per]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class GeminiStepper(Protocol):
    """What `train_step` needs of a Gemini optimizer (cx_zero.gemini.GeminiOptimizer)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self, *args: Any, **kwargs: Any) -> Any: ...


def train_step(ddp: nn.Module, optimizer: GeminiStepper, rank: int, world_size: int, step: int) -> None:
    """One Gemini step on this rank's rows of the step's batch (the Reference trains on the whole batch)."""
    x, y = batch(step, world_size)
    optimizer.zero_grad()
    optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
    optimizer.step()


class Reference:
    """Single-process data parallelism over `world_size` replicas, fp32 master weights, any torch optimizer."""

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        dtype: torch.dtype = torch.float32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
    ) -> None:
        self.master = model
        self.compute = copy.deepcopy(model).to(dtype)
        self.losses: list[float] = []
        self.world_size = world_size
        self.dtype = dtype
        self.optimizer = make_optimizer(list(self.master.parameters()))
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.last_norm: float | None = None

    def grads(
        self, step: int, micro: int = MICRO, forward_kwargs: dict[str, object] | None = None
    ) -> list[torch.Tensor | None]:
        """Averaged fp32 gradients of `step` in `master.parameters()` order (None: unused or frozen)."""
        x, y = batch(step, self.world_size, micro)
        params = list(self.compute.parameters())
        trainable = [p for p in params if p.requires_grad]
        total: dict[int, torch.Tensor] = {}
        self.losses = []
        for r in range(self.world_size):
            logits = self.compute(local(x, r, self.world_size), **(forward_kwargs or {}))
            loss = lm_loss(logits, local(y, r, self.world_size))
            self.losses.append(float(loss.detach()))
            grads = torch.autograd.grad(loss, trainable, allow_unused=True)
            for p, g in zip(trainable, grads, strict=True):
                if g is not None:
                    total[id(p)] = total.get(id(p), torch.zeros_like(p, dtype=torch.float32)) + g.float()
        return [total[id(p)] / self.world_size if id(p) in total else None for p in params]

    def apply(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.master.parameters(), grads, strict=True):
            p.grad = None if g is None else g.clone()
        if self.max_norm > 0:
            self.last_norm = float(
                torch.nn.utils.clip_grad_norm_(list(self.master.parameters()), self.max_norm, self.norm_type)
            )
        self.optimizer.step()
        self.optimizer.zero_grad()
        with torch.no_grad():
            for c, m in zip(self.compute.parameters(), self.master.parameters(), strict=True):
                c.copy_(m.to(self.dtype))

    def step(self, step: int, **forward_kwargs: object) -> None:
        self.apply(self.grads(step, forward_kwargs=forward_kwargs))

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.master.state_dict().items()}


def assert_state_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float, what: str = ""
) -> None:
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for name, value in want.items():

        def message(text: str, name: str = name) -> str:
            return f"{what} {name}: {text}"

        torch.testing.assert_close(got[name].float(), value.float(), rtol=rtol, atol=atol, msg=message)
