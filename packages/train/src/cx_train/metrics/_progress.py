"""One training step's numbers and the progress line rank 0 prints.

The loss comes from the model's own forward (`model(input_ids=..., labels=..., position_ids=...).loss` for
transformers models, which already includes `router_aux_loss_coef * aux_loss` for MoE models): a mean over the
batch's target tokens. The logged loss is the mean over every target token of the step: each micro-batch's and each
data-parallel rank's mean weighted by its number of targets (sum of mean_i x n_i / sum of n_i is exact).
For a model with experts the step also asks for `output_router_logits=True` and counts, per MoE layer, the tokens
each expert receives (the top-k of the router logits: exact for softmax and plain sigmoid routers). Ranks are
combined with ONE all-reduce per step; under a pipeline only the last stage has the MoE numbers, so a second,
two-number all-reduce first agrees on their shape.
Both are cx-mesh's named all-reduce: a stuck or failed peer is reported by name, not as a bare gloo error.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import all_reduce
from cx_train.data._packing import PackedBatch
from cx_train.metrics._log_record import LogRecord
from cx_train.metrics._memory import MemorySample
from cx_train.models._spec import DescribedModel

__all__ = ["SUMMARY_STEPS", "Progress", "StepOutput", "batch_targets", "expert_counts", "forward_step", "loss_summary"]

SUMMARY_STEPS = 10  # the closing line compares the mean loss of this many first and last steps


@dataclass(frozen=True)
class StepOutput:
    loss: torch.Tensor | None  # None on pipeline stages that do not compute it
    aux: torch.Tensor | None  # the MoE load-balancing loss (unscaled), when the model reports one
    expert_counts: torch.Tensor | None  # [MoE layers, experts]: tokens routed to each expert this step
    grad_norm: torch.Tensor | None = None  # the global norm before clipping, where the step measured it
    targets: float = 1.0  # the tokens `loss` is a mean over (the weight of this rank's loss in the step's mean)


def expert_counts(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Tokens per expert in each layer, from router logits `[tokens, experts]` per layer."""
    counts = []
    for logits in router_logits:
        chosen = logits.detach().topk(top_k, dim=-1).indices.flatten()
        counts.append(torch.bincount(chosen, minlength=logits.shape[-1]))
    return torch.stack(counts).to(torch.float64)


def batch_targets(batch: torch.Tensor | PackedBatch) -> int:
    """The tokens the loss of `batch` is a mean over (a plain [B, L] tensor: every token after the first)."""
    if isinstance(batch, PackedBatch):
        return batch.targets()
    return batch.shape[0] * (batch.shape[1] - 1)


def forward_step(model: nn.Module, batch: torch.Tensor | PackedBatch, described: DescribedModel) -> StepOutput:
    """The loss of next-token prediction on `batch` (and the MoE numbers when the model has experts). A packed batch
    goes in with its labels and position ids: transformers and cx's reference GPT alike restart positions and mask
    attention at the documents' boundaries."""
    targets = float(batch_targets(batch))
    if isinstance(batch, PackedBatch):
        if not described.spec.is_hf:
            loss = model(batch.input_ids, labels=batch.labels, position_ids=batch.position_ids)
            return StepOutput(loss, None, None, targets=targets)
        # use_cache=False: with a cache (a model folder's config has use_cache=True) transformers skips the packed-
        # sequence mask that restarting position ids select, and documents would attend to each other
        inputs: dict[str, Any] = {"input_ids": batch.input_ids, "labels": batch.labels,
                                  "position_ids": batch.position_ids, "use_cache": False}  # fmt: skip
    else:
        if not described.spec.is_hf:
            return StepOutput(model(batch, labels=batch), None, None, targets=targets)
        inputs = {"input_ids": batch, "labels": batch}
    moe = described.num_experts > 0
    outputs = model(**inputs, **({"output_router_logits": True} if moe else {}))
    router = getattr(outputs, "router_logits", None)
    counts = expert_counts(router, described.top_k) if moe and router else None
    return StepOutput(outputs.loss, getattr(outputs, "aux_loss", None), counts, targets=targets)


class Progress:
    """Losses averaged over the ranks that computed one; the other numbers of a log step (`LogRecord`) taken over the
    steps since the previous one. Timing starts at construction: this run's first step, also when resumed."""

    def __init__(
        self,
        total_steps: int,
        device: torch.device,
        stages_differ: bool = False,
        start_step: int = 0,
        model_flops_per_token: float | None = None,
        peak_flops: float | None = None,
    ) -> None:
        self.total_steps = total_steps
        self._stages_differ = stages_differ  # pipeline: expert counts only on the last stage
        self.losses: list[float] = []
        self._device = device
        self._start_step = start_step
        self._flops_per_token = model_flops_per_token
        self._peak = peak_flops  # every rank's peak together: one device's x the world size
        self._aux: list[float] = []
        self._counts: torch.Tensor | None = None
        self._tokens = 0
        self._window_losses = 0
        self._eval: tuple[int, float] | None = None  # (step, loss) of an evaluation not yet logged
        self._started = self._window_started = time.perf_counter()

    def record(self, output: StepOutput, tokens: int, stop: bool = False) -> bool:
        """Add one step (collective: every rank calls it with the same kinds of numbers). `stop` is this rank's
        Ctrl-C request; the same all-reduce that sums the step's numbers tells whether any rank made one, so the
        ranks agree to stop at this step without a collective of its own. Returns that agreement."""
        counts = self._agreed_counts(output.expert_counts) if self._stages_differ else output.expert_counts
        parts = []
        for value, weight in ((output.loss, output.targets), (output.aux, 1.0)):
            present = value is not None
            weight = weight if present else 0.0
            number = value.detach().to(torch.float64).reshape(1) * weight if value is not None else torch.zeros(1)
            parts += [number.to(self._device), torch.tensor([weight], device=self._device)]
        parts.append(torch.tensor([float(stop)], device=self._device))
        if counts is not None:
            parts.append(counts.to(self._device, torch.float64).flatten())
        packed = torch.cat([p.to(torch.float64) for p in parts])
        all_reduce(packed, what="progress-line all-reduce (the step's loss, aux loss, stop flag, expert counts)")
        loss_sum, loss_targets, aux_sum, aux_ranks, stops = (float(v) for v in packed[:5])
        self.losses.append(loss_sum / loss_targets if loss_targets else 0.0)
        self._window_losses += 1
        if aux_ranks:
            self._aux.append(aux_sum / aux_ranks)
        if counts is not None:
            summed = packed[5:].view(counts.shape).cpu()
            self._counts = summed if self._counts is None else self._counts + summed
        self._tokens += tokens
        return stops > 0

    def _agreed_counts(self, counts: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's counts, or zeros of the shape the ranks holding counts have (None when no rank has any)."""
        shape = torch.tensor(counts.shape if counts is not None else (0, 0), dtype=torch.int64, device=self._device)
        all_reduce(shape, op=dist.ReduceOp.MAX, what="progress-line all-reduce (the expert counts' shape)")
        layers, experts = (int(v) for v in shape)
        if counts is not None or layers == 0:
            return counts
        return torch.zeros(layers, experts, dtype=torch.float64)

    def note_eval(self, step: int, loss: float) -> None:
        """An evaluation's mean loss at `step`, reported by the next log step (evaluations need not be log steps)."""
        self._eval = (step, loss)

    def record_for(self, step: int, memory: MemorySample, lr: float, grad_norm: float | None = None) -> LogRecord:
        """The numbers of log step `step`; starts a new window (loss, MoE numbers, tokens/s, ms/step)."""
        now = time.perf_counter()
        window = max(self._window_losses, 1)
        seconds = max(now - self._window_started, 1e-9)
        elapsed = now - self._started
        done = max(step - self._start_step, 1)
        balance: float | None = None
        if self._counts is not None:  # the worst layer's busiest expert against the mean expert
            balance = float((self._counts.max(dim=1).values / self._counts.mean(dim=1).clamp_min(1e-9)).max())
        tokens_per_s = self._tokens / seconds
        mfu = None
        if self._flops_per_token is not None and self._peak:
            mfu = tokens_per_s * self._flops_per_token / self._peak
        record = LogRecord(
            step=step,
            total_steps=self.total_steps,
            loss=sum(self.losses[-window:]) / window,
            lr=lr,
            grad_norm=grad_norm,
            tokens_per_s=tokens_per_s,
            step_ms=1000 * seconds / window,
            elapsed_s=elapsed,
            eta_s=elapsed / done * (self.total_steps - step),
            memory=memory,
            aux_loss=sum(self._aux) / len(self._aux) if self._aux else None,
            expert_balance=balance,
            expert_counts=None if self._counts is None else self._counts.tolist(),
            mfu=mfu,
            eval_loss=None if self._eval is None else self._eval[1],
            eval_step=None if self._eval is None else self._eval[0],
        )
        self._aux, self._counts, self._tokens, self._window_losses, self._eval = [], None, 0, 0, None
        self._window_started = now
        return record

    def report(self, step: int, memory: MemorySample, lr: float, grad_norm: float | None = None) -> LogRecord:
        """Print the progress line of `step` on rank 0; returns its numbers (on every rank)."""
        record = self.record_for(step, memory, lr, grad_norm)
        if dist.get_rank() == 0:
            print(record.line(), file=sys.stdout, flush=True)
        return record


def loss_summary(losses: Sequence[float]) -> str | None:
    """The closing line: the mean loss of this run's first and last `SUMMARY_STEPS` steps (a mean, as one step's loss
    is noisy), saying so; None for a run too short to have both."""
    n = SUMMARY_STEPS
    if len(losses) < 2 * n:
        return None
    first, last = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return f"cx-train: loss {first:.3f} -> {last:.3f} (mean of this run's first and last {n} steps)"
