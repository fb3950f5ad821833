"""Reduce each step's contribution to a tied parameter's gradient once, however many steps accumulate into `.grad`.

A parameter tied over pipeline stages (`SharedParameter` with a group) has its gradient summed over those stages
after each `forward_backward_step`. Gradients may accumulate over several steps before the optimizer steps (plain
accumulation, or ZeRO under `no_sync`); summing the whole accumulated `.grad` in every step would count each earlier
step again. So the gradient accumulated so far is set aside while the step runs, the step's own gradient is summed
over the stages, and the earlier one is added back: one extra gradient-sized tensor alive during the step, only
when something had accumulated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cx_pipeline._model import SharedParameter

__all__ = ["TiedGradients"]


class TiedGradients:
    """Holds the tied parameters' earlier gradients aside for one step (see module docs)."""

    def __init__(self, ties: Sequence[SharedParameter]) -> None:
        self._ties = [tie for tie in ties if tie.group is not None and tie.param.requires_grad]
        self._earlier: list[torch.Tensor | None] = [tie.param.grad for tie in self._ties]
        for tie in self._ties:
            tie.param.grad = None

    def reduce(self) -> None:
        """Sum this step's gradient over the stages holding each tie, then add back what had accumulated before."""
        for tie in self._ties:
            tie.all_reduce_grad()
        self.restore()

    def restore(self) -> None:
        """Add the earlier gradients back (after `reduce`, or unreduced when the step failed)."""
        for tie, earlier in zip(self._ties, self._earlier, strict=True):
            if earlier is None:
                continue
            grad = tie.param.grad
            if grad is None:
                tie.param.grad = earlier
            else:
                earlier.add_(grad)  # the step's gradient into the earlier tensor: the object .grad was before
                tie.param.grad = earlier
        self._earlier = [None] * len(self._ties)
