"""Model FLOPs utilisation on CUDA: the model's training FLOPs per token against the device's peak.

FLOPs per token is the usual estimate for a decoder: 6 x the parameters a token passes through (2 for the forward
multiply-adds, 4 for the backward), attention's sequence-length term left out (PaLM, appendix B). A mixture of experts
counts its active parameters: every parameter outside the routed experts, plus top_k / experts of theirs. The peaks
are NVIDIA's datasheet bf16 dense figures (no sparsity); an unknown device, a CPU or --precision fp32 gets no MFU
rather than a wrong one.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["active_parameters", "flops_per_token", "peak_flops"]

# (substring of torch.cuda.get_device_name, bf16 dense FLOP/s), most specific first
_PEAKS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's bf16 dense peak in FLOP/s, or None (not CUDA, not bf16/fp16, or a device not in the table)."""
    if device.type != "cuda" or precision not in ("bf16", "fp16"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAKS if key in name), None)


def active_parameters(model: nn.Module, num_experts: int, top_k: int) -> int:
    """Parameters one token passes through. The routed experts' (a parameter whose name has an `experts` part, as
    `mlp.experts.gate_up_proj` or `block_sparse_moe.experts.3.w1`; `shared_experts` always run) count top_k /
    experts of their number."""
    total = routed = 0
    for name, parameter in model.named_parameters():
        total += parameter.numel()
        if num_experts and "experts" in name.split("."):
            routed += parameter.numel()
    if not routed:
        return total
    return total - routed + routed * top_k // num_experts


def flops_per_token(active: int) -> float:
    """Training FLOPs per token (forward and backward) of a decoder with `active` parameters per token."""
    return 6.0 * active
