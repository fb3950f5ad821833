"""Gemini's rough edges (issue 11), module outputs: dataclasses, NamedTuples and objects that hide tensors from
torch's pytree. Training is checked against single-process PyTorch; a hidden tensor that needs a gradient raises a
clear error on every rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import assert_state_close, local
from zero_gemini_rough_models import ATOL, BLOCK_NUMEL, DIM, RTOL, Block, adamw, regression, sgd


# ------------------------------------------------------------------------------------- structured outputs
@dataclass
class BlockOutput:
    hidden: torch.Tensor
    extra: dict[str, torch.Tensor]
    note: str = "block"


class Pair(NamedTuple):
    hidden: torch.Tensor
    scale: float


class DataclassBlock(Block):
    def forward(self, x: torch.Tensor) -> BlockOutput:  # type: ignore[override]
        h = super().forward(x)
        return BlockOutput(hidden=h, extra={"square": h.square()})


class PairBlock(Block):
    def forward(self, x: torch.Tensor) -> Pair:  # type: ignore[override]
        return Pair(super().forward(x), 0.5)


class Structured(nn.Module):
    """Inner modules return a dataclass and a NamedTuple; the model returns a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.first = DataclassBlock()
        self.second = PairBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> BlockOutput:
        a = self.first(x)
        b = self.second(a.hidden + 0.1 * a.extra["square"])
        return BlockOutput(hidden=self.head(b.hidden * b.scale), extra={})


def _structured(seed: int = 0) -> Structured:
    torch.manual_seed(seed)
    return Structured()


@distributed(world_size=2)
@pytest.mark.parametrize("config", [None, {"chunk_size": BLOCK_NUMEL}])
def test_zero_gemini_rough_edges_dataclass_outputs_match_pytorch(
    rank: int, world_size: int, config: dict[str, int] | None
) -> None:
    """Modules returning a dataclass (unregistered with pytree), a NamedTuple, and a wrapped model returning a
    dataclass: every unit is gathered again for backward, and training matches PyTorch (fp32 outputs forced)."""
    reference = _structured()
    ref_optimizer = adamw(list(reference.parameters()))
    ddp = GeminiDDP(_structured(), chunk_config_dict=config, mixed_precision=torch.float32, force_outputs_fp32=True)
    optimizer = GeminiOptimizer(adamw(list(ddp.parameters())), ddp)
    for index in range(3):
        x, y = regression(index, world_size)
        optimizer.zero_grad()
        out = ddp(local(x, rank, world_size))
        assert isinstance(out, BlockOutput)
        optimizer.backward(F.mse_loss(out.hidden, local(y, rank, world_size)))
        optimizer.step()
        ref_optimizer.zero_grad()
        losses = [
            F.mse_loss(reference(local(x, r, world_size)).hidden, local(y, r, world_size)) for r in range(world_size)
        ]
        torch.stack(losses).mean().backward()
        ref_optimizer.step()
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, f"step {index}")


class Opaque:
    """Holds a tensor where neither torch's pytree nor dataclass fields can see it."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class OpaqueBlock(Block):
    def forward(self, x: torch.Tensor) -> Opaque:  # type: ignore[override]
        return Opaque(super().forward(x))


class OpaqueModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = OpaqueBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x).hidden)
        return out


class CarryingBlock(Block):
    """Returns a tensor and, beside it, an opaque object holding another (as a key/value cache would)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Opaque]:  # type: ignore[override]
        h = super().forward(x)
        return h, Opaque(2 * h)


class CarryingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = CarryingBlock()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x)[0])
        return out


@distributed(world_size=2)
def test_zero_gemini_rough_edges_opaque_output_raises_naming_its_type(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    ddp = GeminiDDP(OpaqueModel(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    x, _ = regression(0, world_size)
    with pytest.raises(TypeError, match=r"module 'block' returned a .*Opaque.*register_pytree_node"):
        ddp(x)
    with torch.no_grad():  # without autograd nothing needs gathering again: allowed
        assert ddp(x).shape == (4, 1)
    torch.manual_seed(0)
    reference = CarryingModel()
    torch.manual_seed(0)
    carrying = GeminiDDP(CarryingModel(), chunk_config_dict={"chunk_size": BLOCK_NUMEL}, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(sgd(list(carrying.parameters())), carrying)
    ref_optimizer = sgd(list(reference.parameters()))
    optimizer.backward(carrying(local(x, rank, world_size)).square().mean())  # the visible tensor is enough
    optimizer.step()
    torch.stack([reference(local(x, r, world_size)).square().mean() for r in range(world_size)]).mean().backward()
    ref_optimizer.step()
    assert_state_close(carrying.state_dict(only_rank_0=False), reference.state_dict(), RTOL, ATOL, "carrying")
