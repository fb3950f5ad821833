"""`DDPOptions`: ColossalAI's TorchDDPPlugin arguments (torch DistributedDataParallel's) as one validated group.

TorchDDPPlugin builds it once from its flat keywords; any plugin that wraps a module in DDP (the hybrid plugins at
ZeRO stage 0) takes the group whole and asks it for DDP's keyword arguments.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["DDPOptions"]


@dataclass(frozen=True)
class DDPOptions:
    """The DistributedDataParallel arguments, validated once."""

    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def __post_init__(self) -> None:
        if self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}")

    def hints_given(self) -> list[str]:
        """The DDP performance hints set to a non-default value (for a plugin that reduces gradients itself, where
        they change nothing)."""
        hints = ("find_unused_parameters", "check_reduction", "gradient_as_bucket_view", "static_graph")
        return [name for name in hints if getattr(self, name)]

    def ddp_kwargs(self, device: torch.device) -> dict[str, Any]:
        """Keyword arguments for `DistributedDataParallel` on `device` (process group not included)."""
        kwargs: dict[str, Any] = asdict(self)
        if self.broadcast_buffers:
            del kwargs["broadcast_buffers"]  # True is DDP's default; passing it explicitly warns on torch 2.13
        if device.type == "cuda":
            kwargs["device_ids"] = [device.index]
        return kwargs
