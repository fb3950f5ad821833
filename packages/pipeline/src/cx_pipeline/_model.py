"""`PipelineModel`: this rank's chunks of a model split into stages, and the parameters it shares with other stages.

Tied weights (input embedding on the first stage, output head on the last) are held as one parameter on each stage
that uses them, initialised to the same value. After the backward passes of a step their gradients are summed over
the stages holding them (Megatron's embedding group), so every copy receives the same update and they stay one value.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import all_reduce

__all__ = ["PipelineModel", "SharedParameter"]


@dataclass(eq=False)
class SharedParameter:
    """A parameter held by several pipeline stages; `group` spans their ranks (None when this rank holds them all)."""

    name: str
    param: nn.Parameter
    stages: tuple[int, ...]
    group: dist.ProcessGroup | None

    def all_reduce_grad(self) -> None:
        """Sum the gradient over the stages holding the parameter (a zero gradient where one stage did not use it)."""
        if self.group is None or not self.param.requires_grad:
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        all_reduce(self.param.grad, group=self.group)


class PipelineModel(nn.Module):
    """The chunks this rank runs (one per model chunk, in chunk order) and its shared parameters.

    `forward` is deliberately absent: a pipeline model runs through a schedule's `forward_backward_step`.
    """

    def __init__(self, chunks: Iterable[nn.Module], shared: Iterable[SharedParameter] = ()) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.shared: list[SharedParameter] = list(shared)

    def sync_shared_params_grads(self) -> None:
        """Sum the gradients of the parameters shared between stages (ColossalAI's name for this step)."""
        for shared in self.shared:
            shared.all_reduce_grad()
