"""What the optimisation flags do to a run: AdamW with `--weight-decay`, the `--lr-schedule` / `--warmup-steps`
scheduler (cx_plugins.lr_scheduler), `--activation-checkpointing` and `--compile` applied to the model before it is
boosted, and one optimizer step over `--grad-accum` micro-batches with `--clip`.

Accumulation is cx-plugins' `accumulated_step` (all but the last micro-batch under `booster.no_sync`, the loss
scaled by 1/N), the step cx-plan measures. The gradient is the mean of the micro-batches' per-token means (a
micro-batch with fewer target tokens, as packed chats have, weighs as much as one with more); the logged loss is the
mean over all their target tokens. The scheduler steps once per optimizer step; its position is saved
with the checkpoint (`lr_scheduler.json`), so a resumed run continues the same curve.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from cx_plugins import Booster, OptimizerWrapper, accumulated_step, enable_activation_checkpointing
from cx_plugins.lr_scheduler import CosineAnnealingWarmupLR, LambdaLR, LinearWarmupLR
from cx_train.config._options import HYBRID_CLASSES, TrainOptions
from cx_train.data._packing import PackedBatch
from cx_train.metrics._progress import StepOutput, forward_step
from cx_train.models._spec import DescribedModel
from cx_zero import CPUAdam, FusedAdam, HybridAdam, MuonWithAdamW, muon_param_groups

__all__ = ["make_optimizer", "make_scheduler", "micro_step", "prepare_model"]


_OPTIMIZERS: dict[str, type[CPUAdam]] = {
    "hybrid_adam": HybridAdam,
    "fused_adam": FusedAdam,
    "cpu_adam": CPUAdam,
}


def make_optimizer(model: nn.Module, options: TrainOptions, eps: float = 1e-8) -> torch.optim.Optimizer:
    """`--optimizer` over the trainable parameters (under LoRA, the adapters): torch's AdamW or one of cx-zero's
    fused Adam(W)s in AdamW mode, the same update; or cx-zero's MuonWithAdamW (muon: hidden matrices by Muon, 1-D
    parameters, embeddings and the output head by AdamW, `muon_param_groups`), with Muon's "match_rms_adamw" scaling
    so that one --lr and --weight-decay suit both kinds (Moonshot's recipe, "Muon is Scalable for LLM Training")."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    if options.optimizer == "muon":
        return MuonWithAdamW(
            muon_param_groups(model),
            lr=options.lr,
            weight_decay=options.weight_decay,
            adjust_lr_fn="match_rms_adamw",
            adamw_weight_decay=options.weight_decay,
            adamw_eps=eps,
        )
    if options.optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=options.lr, weight_decay=options.weight_decay, eps=eps)
    kind = _OPTIMIZERS[options.optimizer]
    return kind(parameters, lr=options.lr, weight_decay=options.weight_decay, eps=eps, adamw_mode=True)


@dataclass(frozen=True)
class _WarmupThenConstant:
    """ColossalAI's warm-up convention (step s < w runs at (s + 1) / w of the rate), then the rate itself; a
    dataclass, so torch's LambdaLR stores its fields (plain data) in the state dict."""

    warmup_steps: int

    def __call__(self, step: int) -> float:
        return (step + 1) / self.warmup_steps if step < self.warmup_steps else 1.0


def make_scheduler(optimizer: torch.optim.Optimizer, options: TrainOptions) -> LRScheduler:
    """The schedule over `--steps` optimizer steps (the total to reach, also when resuming)."""
    total, warmup = options.steps, options.warmup_steps
    if options.lr_schedule == "cosine":
        return CosineAnnealingWarmupLR(optimizer, total, warmup_steps=warmup, eta_min=0.0)
    if options.lr_schedule == "linear":
        return LinearWarmupLR(optimizer, total, warmup_steps=warmup)
    if options.lr_schedule == "constant":
        return LambdaLR(optimizer, total, lr_lambda=_WarmupThenConstant(warmup))
    raise ValueError(f"--lr-schedule {options.lr_schedule!r}: not one of constant, linear, cosine")


def prepare_model(model: nn.Module, options: TrainOptions, is_hf: bool) -> nn.Module:
    """The model with `--activation-checkpointing` / `--compile` applied, before boosting. The hybrid plugins
    checkpoint through ShardFormer instead (`_plugins.hybrid_arguments`), which replaces the layers' forwards."""
    if options.activation_checkpointing and options.plugin not in HYBRID_CLASSES:
        if not is_hf:  # refused before any process started (_training_checks)
            raise ValueError("--activation-checkpointing needs a transformers model")
        enable_activation_checkpointing(model, options.checkpoint_mode)  # non-reentrant; selective-op: the op policy
    if options.compile:
        model.compile(
            backend=options.compile_backend
        )  # in place: the state dict keeps its names, so checkpoints stay interchangeable
    return model


def micro_step(
    booster: Booster,
    model: nn.Module,
    optimizer: OptimizerWrapper,
    batches: Sequence[torch.Tensor | PackedBatch],
    described: DescribedModel,
    clip: float = 0.0,
) -> StepOutput:
    """`accumulated_step` with cx-train's forward; the step's loss is the mean over the micro-batches' target tokens,
    the MoE aux loss the micro-batches' mean, the expert counts their sum."""
    outputs: list[StepOutput] = []

    def forward(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        outputs.append(forward_step(module, cast(torch.Tensor | PackedBatch, batch), described))
        loss = outputs[-1].loss
        assert loss is not None
        return loss

    # accumulated_step hands each micro-batch to `forward` untouched, whatever it is
    losses, norm = accumulated_step(booster, model, optimizer, cast(Sequence[torch.Tensor], batches), forward, clip)
    aux = [o.aux.detach() for o in outputs if o.aux is not None]
    counts = [o.expert_counts for o in outputs if o.expert_counts is not None]
    weights = torch.tensor([o.targets for o in outputs], dtype=torch.float64)
    total = float(weights.sum())
    mean = sum(loss.to(torch.float64) * w for loss, w in zip(losses, weights.tolist(), strict=True)) / max(total, 1.0)
    return StepOutput(
        torch.as_tensor(mean),
        torch.stack(aux).mean() if aux else None,
        torch.stack(counts).sum(dim=0) if counts else None,
        norm,
        targets=total,
    )
