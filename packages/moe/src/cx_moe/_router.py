"""`TopKRouter`: token-choice top-k routing with fp32 scoring, optional renormalisation, jitter, group-limited
selection and an aux-loss-free selection bias; it keeps its latest load-balancing and z-loss for
`collect_router_losses`."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from cx_moe._losses import load_balancing_loss, router_z_loss, tokens_per_expert
from cx_moe._options import RouterOptions, ScoreFunction

__all__ = ["RouterOutput", "TopKRouter", "collect_router_losses", "select_experts"]


class RouterOutput(NamedTuple):
    """`logits` [T, E] fp32; `probs` [T, E] fp32 rows summing to 1 (softmax, or the normalised sigmoid scores: what
    the load-balancing loss uses); `weights` [T, k] fp32 combine weights; `indices` [T, k] int64 chosen experts."""

    logits: torch.Tensor
    probs: torch.Tensor
    weights: torch.Tensor
    indices: torch.Tensor


def select_experts(
    scores: torch.Tensor, options: RouterOptions, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], indices [T, k]) from fp32 scores [T, E]. `bias` shifts the scores for the choice only;
    weights are the unbiased scores of the chosen experts (normalised and scaled per `options`)."""
    choice = scores.detach() if bias is None else scores.detach() + bias
    if options.num_groups > 1:
        tokens, per_group = choice.shape[0], options.num_experts // options.num_groups
        grouped = choice.view(tokens, options.num_groups, per_group)
        # DeepSeek-V3: a group is worth its two best experts (its best one when groups hold a single expert)
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        keep = group_scores.topk(options.top_k_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), -math.inf).view(tokens, options.num_experts)
    indices = choice.topk(options.top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if options.normalize_top_k:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if options.scaling_factor != 1.0:
        weights = weights * options.scaling_factor
    return weights, indices


class TopKRouter(nn.Module):
    """Scores tokens [T, H] against `weight [E, H]` in fp32 and picks each token's top-k experts.

    With `options.expert_bias`, the buffer `expert_bias [E]` shifts selection (never the weights) and
    `expert_load [E]` counts training-mode assignments until `update_expert_bias` consumes them.
    """

    def __init__(
        self,
        hidden_size: int,
        options: RouterOptions,
        *,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.options = options
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(options.num_experts, hidden_size, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        self.expert_bias: torch.Tensor | None
        self.expert_load: torch.Tensor | None
        if options.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(options.num_experts, device=device))
            self.register_buffer("expert_load", torch.zeros(options.num_experts, device=device), persistent=False)
        else:
            self.expert_bias = None
            self.expert_load = None
        self.aux_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> RouterOutput:
        x = hidden_states.reshape(-1, self.hidden_size)
        if self.training and self.options.jitter_noise > 0:
            eps = self.options.jitter_noise
            x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        logits = F.linear(x.float(), self.weight.float())
        if self.options.score is ScoreFunction.SOFTMAX:
            scores = torch.softmax(logits, dim=-1)
            probs = scores
        else:
            scores = torch.sigmoid(logits)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        weights, indices = select_experts(scores, self.options, self.expert_bias)
        if self.options.aux_loss_coef > 0:
            self.aux_loss = load_balancing_loss(probs, indices, self.options.num_experts)
        if self.options.z_loss_coef > 0:
            self.z_loss = router_z_loss(logits)
        if self.expert_load is not None and self.training:
            with torch.no_grad():
                self.expert_load += tokens_per_expert(indices, self.options.num_experts)
        return RouterOutput(logits, probs, weights, indices)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, {self.options}"


def collect_router_losses(module: nn.Module) -> torch.Tensor:
    """The sum over every `TopKRouter` in `module` of `aux_loss_coef * aux_loss + z_loss_coef * z_loss` from its
    latest forward, which it then forgets (so one forward's losses are added once). Add it to the task loss.
    Zero (a plain tensor) when no router recorded a loss."""
    total: torch.Tensor | None = None
    for router in module.modules():
        if not isinstance(router, TopKRouter):
            continue
        for loss, coef in (
            (router.aux_loss, router.options.aux_loss_coef),
            (router.z_loss, router.options.z_loss_coef),
        ):
            if loss is not None:
                total = loss * coef if total is None else total + loss * coef
        router.aux_loss = None
        router.z_loss = None
    return torch.zeros(()) if total is None else total
