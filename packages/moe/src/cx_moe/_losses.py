"""Router regularisers: the Switch load-balancing loss and the ST-MoE router z-loss.

`load_balancing_loss(probs, indices, num_experts)` is E * sum_e f_e * P_e, with f_e the number of the T tokens'
top-k assignments that went to expert e divided by T (so sum_e f_e = k, as transformers counts) and P_e the mean
routing probability of expert e. On softmax router logits and their top-k this is exactly transformers'
`load_balancing_loss_func` for one layer; `pooled_load_balancing_loss` pools several layers' counts and
probabilities before multiplying, as transformers does over a model's layers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["load_balancing_loss", "pooled_load_balancing_loss", "router_z_loss", "tokens_per_expert"]


def tokens_per_expert(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, slot) assignments each expert got: [num_experts] float32."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=indices.device)
    flat = indices.reshape(-1)
    return counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))


def pooled_load_balancing_loss(
    probs: Sequence[torch.Tensor], indices: Sequence[torch.Tensor], num_experts: int
) -> torch.Tensor:
    """Switch load-balancing loss over several layers, with counts and probabilities pooled before multiplying.

    `probs[i]`: [T_i, E] routing probabilities (rows summing to 1); `indices[i]`: [T_i, k] chosen experts.
    No tokens at all gives a zero that still depends on `probs` (so backward reaches the router).
    """
    if len(probs) != len(indices) or not probs:
        raise ValueError(f"need one index tensor per probability tensor, got {len(probs)} and {len(indices)}")
    device = probs[0].device
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = 0
    for p, idx in zip(probs, indices, strict=True):
        counts = counts + tokens_per_expert(idx.to(device), num_experts)
        prob_sum = prob_sum + p.float().sum(dim=0)
        rows += p.shape[0]
    if rows == 0:
        return prob_sum.sum() * 0.0
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def load_balancing_loss(probs: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """One layer's Switch load-balancing loss (see the module docstring)."""
    return pooled_load_balancing_loss([probs], [indices], num_experts)


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss: the mean over tokens of logsumexp(logits)^2 (keeps logits small); 0 without tokens."""
    if logits.shape[0] == 0:
        return logits.float().sum() * 0.0
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
