"""`--eval-every N`: the mean loss (and perplexity, exp of it) over every target token of the evaluation windows.

Every data-parallel rank takes its slice of each global batch of evaluation windows; every rank runs the same number
of forward passes (a sharded model's forward is collective), a rank with no window left runs one window with weight 0.
Each batch's loss is a mean over its target tokens, so weighting it by their number gives the exact token mean of
the set (not a mean of per-window means): what transformers computes document by document, packed or not.
`EvalResult` is what the progress line prints and what a metrics log records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from cx_mesh import all_reduce
from cx_train.data._user_data import UserData
from cx_train.metrics._progress import forward_step
from cx_train.models._spec import DescribedModel

__all__ = ["EvalResult", "evaluate"]


@dataclass(frozen=True)
class EvalResult:
    step: int
    loss: float
    perplexity: float
    windows: int

    def line(self) -> str:
        return f"cx-train: eval step {self.step}: loss {self.loss:.4f} perplexity {self.perplexity:.2f}"


def evaluate(
    model: nn.Module,
    data: UserData,
    described: DescribedModel,
    batch_size: int,
    dp: tuple[int, int],
    device: torch.device,
    step: int,
) -> EvalResult:
    """Collective: every rank calls it at the same step."""
    windows = data.evaluation
    assert windows is not None, "evaluate() needs --eval-data or --eval-fraction"
    dp_rank, dp_size = dp
    global_batch = batch_size * dp_size
    total = torch.zeros(2, dtype=torch.float64, device=device)  # sum of loss x targets, targets
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, len(windows), global_batch):
            first = min(start + dp_rank * batch_size, len(windows))
            indices = torch.arange(first, min(first + batch_size, len(windows)))
            real = indices.numel() > 0
            if not real:
                indices = torch.zeros(1, dtype=torch.long)
            batch = windows.batch(indices)
            weight = batch.targets() if real else 0  # counted on the host, before the batch moves
            loss = forward_step(model, batch.to(device), described).loss
            assert loss is not None
            if weight:  # on the device: no sync per batch
                total[0] += loss.detach().to(total.device, torch.float64) * weight
                total[1] += weight
    model.train(was_training)
    # tp / pp / sp ranks of a replica add the same numbers: the ratio is unchanged
    all_reduce(total, what="evaluation all-reduce (loss sum, target tokens)")
    mean = float(total[0] / total[1])
    return EvalResult(step, mean, math.exp(min(mean, 700.0)), len(windows))
