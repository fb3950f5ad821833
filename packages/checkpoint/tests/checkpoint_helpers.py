"""Small models, optimizers and comparisons shared by the cx-checkpoint tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


class TinyNet(nn.Module):
    """Linear layers, a BatchNorm (float and int64 buffers) and a frozen embedding."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.fc1 = nn.Linear(8, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(torch.relu(self.norm(self.fc1(x + self.embed.weight[:1]))))
        return out


def make_model(seed: int, hidden: int = 16) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(hidden)


OPTIMIZERS: dict[str, Callable[[TinyNet], torch.optim.Optimizer]] = {
    "adam": lambda m: torch.optim.Adam(m.named_parameters(), lr=1e-2),
    "adamw": lambda m: torch.optim.AdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd_momentum": lambda m: torch.optim.SGD(m.named_parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    "groups": lambda m: torch.optim.Adam(
        [
            {"params": list(m.fc1.named_parameters(prefix="fc1")), "lr": 1e-2},
            {"params": list(m.fc2.named_parameters(prefix="fc2")), "lr": 3e-3, "betas": (0.8, 0.9)},
            {"params": list(m.norm.named_parameters(prefix="norm")), "lr": 1e-3, "weight_decay": 0.01},
        ]
    ),
    "frozen": lambda m: _frozen_adam(m),
}


def _frozen_adam(model: TinyNet) -> torch.optim.Optimizer:
    model.embed.weight.requires_grad_(False)  # in the optimizer but never stepped: no state
    model.fc1.requires_grad_(False)
    trainable = [(n, p) for n, p in model.named_parameters() if not n.startswith("fc1")]
    return torch.optim.Adam(trainable, lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int, scheduler: object = None) -> None:
    generator = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        x = torch.randn(6, 8, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()  # type: ignore[attr-defined]


def assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entries in sa["state"].items():
        assert entries.keys() == sb["state"][index].keys()
        for key, value in entries.items():
            other = sb["state"][index][key]
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype, (index, key)
                assert torch.equal(value, other), (index, key)
            else:
                assert value == other, (index, key)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Relative path -> content of every file under `root` (or of `root` itself when it is a file)."""
    if root.is_file():
        return {root.name: root.read_bytes()}
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
