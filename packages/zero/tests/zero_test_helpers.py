"""Shared pieces of cx-zero's tests: tiny models, deterministic data and the single-process PyTorch reference.

The reference trains a plain copy of the model with `torch.optim.AdamW`: each rank's micro-batch gradient is computed
separately (same ops, same dtype as the rank computes) and averaged over the replicas in fp32, which is exactly what
data parallelism means; the optimizer then steps fp32 master copies and casts them back into the model's dtype.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import PerTestCache

IN, HIDDEN, OUT = 7, 13, 5
_MESHES: PerTestCache[int, ProcessGroupMesh] = PerTestCache()
_M = TypeVar("_M", bound=nn.Module)


class MLP(nn.Module):
    """Odd sizes, so that every parameter needs padding at world sizes 2 and 4."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))
        return out


class TinyGPT(nn.Module):
    """Embedding, one pre-LN attention block, tied LM head: a GPT in miniature."""

    def __init__(self, vocab: int = 23, dim: int = 12, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(8, dim) * 0.02)
        self.ln1 = nn.LayerNorm(dim)
        # No projection biases: the key bias has an exactly-zero true gradient (softmax ignores it), so its computed
        # gradient is rounding noise whose sign depends on the summation order, and Adam turns that into +-lr.
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 3 * dim), nn.GELU(), nn.Linear(3 * dim, dim))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:seq]
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, attn_mask=mask, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        logits: torch.Tensor = self.ln_f(h) @ self.embed.weight.t()
        return logits


class Experts(nn.Module):
    """A dense layer, then a toy router that sends each sample to one of `n` experts (some never chosen)."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.dense = nn.Linear(IN, HIDDEN)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, OUT) for _ in range(n))

    def expert_params(self) -> list[nn.Parameter]:
        return list(self.experts.parameters())

    def forward(self, x: torch.Tensor, route: Sequence[int]) -> torch.Tensor:
        h = torch.tanh(self.dense(x))
        return torch.stack([self.experts[e](h[i]) for i, e in enumerate(route)])


def make_model(kind: str = "mlp", seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP() if kind == "mlp" else TinyGPT()


def make_mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def world_group() -> dist.ProcessGroup:
    """The default group as a `ProcessGroup` (a dictionary key for `pg_to_param_list`)."""
    return cast(dist.ProcessGroup, dist.group.WORLD)


def batch(kind: str, step: int, world_size: int, per_rank: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step` (ranks take equal consecutive slices)."""
    g = torch.Generator().manual_seed(1000 + step)
    n = world_size * per_rank
    if kind == "mlp":
        return torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
    tokens = torch.randint(0, 23, (n, 6), generator=g)
    return tokens, tokens.roll(-1, dims=1)


def local(data: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = data.shape[0] // world_size
    return data[rank * per : (rank + 1) * per]


def loss_of(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    if kind == "mlp":
        return ((out.float() - y) ** 2).mean()
    return nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def bound_loss(kind: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    """`model -> loss` on fixed data."""

    def compute(model: nn.Module) -> torch.Tensor:
        return loss_of(kind, model, x, y)

    return compute


class Reference:
    """Single-process data-parallel reference: fp32 masters, torch AdamW, per-replica gradients averaged in fp32."""

    def __init__(self, model: nn.Module, lr: float = 1e-2, weight_decay: float = 0.01, scale: float = 1.0) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.optim = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.scale = scale
        self.last_norm = 0.0

    def grads_of(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> list[torch.Tensor | None]:
        self.model.zero_grad(set_to_none=True)
        (loss_fn(self.model) * self.scale).backward()
        return [None if p.grad is None else p.grad.float() / self.scale for p in self.params]

    def step(self, grads: list[torch.Tensor | None], clip: float = 0.0, norm_type: float = 2.0) -> None:
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad
        present = [m for m in self.masters if m.grad is not None]
        self.last_norm = float(torch.nn.utils.get_total_norm([g for g in grads if g is not None], norm_type))
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(present, clip, norm_type)
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        with torch.no_grad():
            for param, master in zip(self.params, self.masters, strict=True):
                param.copy_(master.to(param.dtype))

    def train_step(self, kind: str, step: int, world_size: int, clip: float = 0.0, norm_type: float = 2.0) -> None:
        x, y = batch(kind, step, world_size)
        per_rank = []
        for r in range(world_size):
            xr, yr = local(x, r, world_size), local(y, r, world_size)
            per_rank.append(self.grads_of(bound_loss(kind, xr, yr)))
        self.step(average(per_rank, 1.0 / world_size), clip, norm_type)


def average(grads: Sequence[list[torch.Tensor | None]], weight: float) -> list[torch.Tensor | None]:
    """Sum of the given gradient lists, each multiplied by `weight` (None where no list has a gradient)."""
    result: list[torch.Tensor | None] = [None] * len(grads[0])
    for grad_list in grads:
        for i, g in enumerate(grad_list):
            if g is not None:
                previous = result[i]
                result[i] = g * weight if previous is None else previous + g * weight
    return result


def clone_model(model: _M, dtype: torch.dtype | None = None) -> _M:
    copied = copy.deepcopy(model)
    return copied.to(dtype) if dtype is not None else copied


def mesh_2x2() -> ProcessGroupMesh:
    """One 2x2 mesh per test (shared by its calls; the harness destroys its groups when the test ends)."""
    if 4 not in _MESHES:
        assert dist.get_world_size() == 4
        _MESHES[4] = ProcessGroupMesh(2, 2, axis_names=("a", "b"))
    return _MESHES[4]


def assert_params_close(
    model: nn.Module, reference: nn.Module, rtol: float, atol: float, what: str = "parameters"
) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=rtol, atol=atol, msg=f"{what}: {name}")


def subgroup(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """`new_group(ranks)`: collective over the world, so every rank calls it for every group (the pooled harness
    destroys a test's groups when it ends, so nothing is cached across tests)."""
    group: dist.ProcessGroup = dist.new_group(list(ranks))
    return group
