"""Small models and data shared by the Gemini rough-edge tests (test_zero_gemini_rough_edges*.py): blocks of a
linear layer and a LayerNorm, one block per chunk with `BLOCK_NUMEL`, and a regression batch per step."""

from __future__ import annotations

import torch
from torch import nn

RTOL, ATOL = 1e-5, 1e-6
DIM = 8


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(torch.tanh(self.fc(x)))
        return out


BLOCK_NUMEL = DIM * DIM + DIM + 2 * DIM  # one block per chunk with this chunk size


class Stack(nn.Module):
    """Blocks run in the order given: the same parameters in any order."""

    def __init__(self, blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self, x: torch.Tensor, order: tuple[int, ...] = (0, 1, 2)) -> torch.Tensor:
        for index in order:
            x = self.blocks[index](x)
        return x


def build_stack(seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack()


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def build_mlp(seed: int = 0) -> Mlp:
    torch.manual_seed(seed)
    return Mlp()


def regression(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(world_size * 2, DIM, generator=gen), torch.randn(world_size * 2, 1, generator=gen)
