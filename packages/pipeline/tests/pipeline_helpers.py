"""Small models and a single-process reference for the pipeline tests.

`ToyNet` implements the `PipelineSplittable` protocol: an input projection (or a tied embedding), residual MLP
blocks that each append a per-sample value to a growing tuple `aux` (a stand-in for MoE router logits that must
reach the last stage), and a head. The reference runs the same micro-batches through the unsplit model in one
process and averages the losses, exactly what a pipeline step computes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineModel,
    PipelineSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
    split_batch,
)

HIDDEN = 16
VOCAB = 24


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = h + self.down(torch.tanh(self.up(self.norm(h))))
        return out


class ToyStage(nn.Module):
    """Layers [start, end) of a ToyNet, with the input side on the first stage and the head on the last."""

    def __init__(self, net: ToyNet, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embed = net.embed if first else None
        self.blocks = nn.ModuleList(net.blocks[start:end])
        self.head = net.head if last else None

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        aux: tuple[torch.Tensor, ...] = (),
    ) -> dict[str, Any]:
        if self.embed is not None:
            h = self.embed(x)
        else:
            assert hidden_states is not None
            h = hidden_states
        aux = tuple(aux)
        for block in self.blocks:
            h = block(h)
            aux = (*aux, h.pow(2).mean(-1))
        if self.head is not None:
            return {"logits": self.head(h), "aux": aux}
        return {"hidden_states": h, "aux": aux}


class ToyNet(nn.Module):
    def __init__(self, num_layers: int, tied: bool = False) -> None:
        super().__init__()
        self.tied = tied
        self.embed: nn.Module = nn.Embedding(VOCAB, HIDDEN) if tied else nn.Linear(8, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(num_layers))
        self.head = nn.Linear(HIDDEN, VOCAB if tied else 4, bias=not tied)
        if tied:
            assert isinstance(self.embed, nn.Embedding)
            self.head.weight = self.embed.weight

    def pipeline_num_layers(self) -> int:
        return len(self.blocks)

    def pipeline_stage_module(self, start: int, end: int, first: bool, last: bool) -> nn.Module:
        return ToyStage(self, start, end, first, last)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self.pipeline_stage_module(0, len(self.blocks), True, True)(x, y)
        return out


def toy_criterion(outputs: Mapping[str, Any], micro_batch: Any) -> torch.Tensor:
    logits = outputs["logits"]
    aux = torch.stack(list(outputs["aux"])).mean()
    if isinstance(micro_batch, Mapping):
        target = micro_batch["y"]
        if target.dtype == torch.long:
            loss: torch.Tensor = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) + 0.1 * aux
            return loss
        loss = F.mse_loss(logits, target) + 0.1 * aux
        return loss
    loss = logits.pow(2).mean() + 0.1 * aux
    return loss


def toy_batch(size: int, tied: bool, as_dict: bool, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    if tied:
        x = torch.randint(0, VOCAB, (size, 5), generator=generator)
        y = torch.randint(0, VOCAB, (size, 5), generator=generator)
    else:
        x = torch.randn(size, 8, generator=generator)
        y = torch.randn(size, 4, generator=generator)
    return {"x": x, "y": y} if as_dict else x


def reference_step(
    model: nn.Module, batch: Any, num_microbatches: int, criterion: Callable[[Any, Any], torch.Tensor]
) -> torch.Tensor:
    """Single process: mean loss over the same micro-batches, backward into `.grad`."""
    total = torch.zeros(())
    for micro in split_batch(batch, num_microbatches):
        out = model(**micro) if isinstance(micro, Mapping) else model(micro)
        loss = criterion(out, micro) / num_microbatches
        loss.backward()
        total = total + loss.detach()
    return total


def build_schedule(
    style: str,
    world_size: int,
    num_microbatches: int,
    layers_per_stage: list[int] | None = None,
    enable_metadata_cache: bool = True,
    overlap_p2p: bool = True,
) -> tuple[PipelineStageManager, PipelineSchedule]:
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    options = {"enable_metadata_cache": enable_metadata_cache, "overlap_p2p": overlap_p2p}
    if style == "1f1b":
        manager = PipelineStageManager(mesh, "pp", num_layers_per_stage=layers_per_stage)
        return manager, OneForwardOneBackwardSchedule(manager, num_microbatches=num_microbatches, **options)
    if style == "interleaved":
        manager = PipelineStageManager(
            mesh, "pp", enable_interleave=True, num_model_chunks=2, num_layers_per_stage=layers_per_stage
        )
        return manager, InterleavedSchedule(manager, num_model_chunks=2, num_microbatch=num_microbatches, **options)
    manager = PipelineStageManager(mesh, "pp", use_zbv=True, num_model_chunks=2, num_layers_per_stage=layers_per_stage)
    return manager, ZeroBubbleVPipeScheduler(manager, num_model_chunks=2, num_microbatch=num_microbatches, **options)


def names_by_identity(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def assert_grads_match(
    pipeline: PipelineModel, full: nn.Module, reference: nn.Module, atol: float = 1e-5, rtol: float = 1e-4
) -> int:
    """Every gradient this rank holds equals the single-process one of the same parameter; returns how many."""
    names = names_by_identity(full)
    expected = dict(reference.named_parameters())
    checked = 0
    for param in {id(p): p for p in pipeline.parameters()}.values():
        name = names[id(param)]
        want = expected[name].grad
        assert want is not None, name
        assert param.grad is not None, f"{name} got no gradient"
        torch.testing.assert_close(param.grad, want, atol=atol, rtol=rtol, msg=f"gradient of {name} differs")
        checked += 1
    return checked


def batches(batch: Any) -> Iterator[Any]:
    while True:
        yield batch
