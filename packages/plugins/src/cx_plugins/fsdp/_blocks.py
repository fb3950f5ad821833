"""`block_wrap_policy(model)`: the FSDP1 auto-wrap policy that gives each decoder layer its own `fully_shard`, as
torchtitan and every FSDP recipe do, so a step gathers one block (and prefetches the next) instead of the whole model.

The decoder layers are the model's largest `nn.ModuleList` by parameter count (transformers' `model.layers`, cx's
GPT `blocks`; a MoE layer's experts sit inside it); the policy is torch's `ModuleWrapPolicy` over their classes.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

__all__ = ["block_classes", "block_wrap_policy", "decoder_layers"]


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The model's decoder layers: its largest non-empty ModuleList by parameter count (None: it has none)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    return max(lists, key=lambda found: sum(p.numel() for p in found.parameters())) if lists else None


def block_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The classes of the model's decoder layers (sorted by name; usually one)."""
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(
            f"TorchFSDPPlugin per-block wrapping: {type(model).__name__} has no nn.ModuleList of decoder layers; "
            "pass auto_wrap_policy yourself (e.g. ModuleWrapPolicy({YourBlock}))"
        )
    return tuple(sorted({type(layer) for layer in layers}, key=lambda cls: cls.__name__))


def block_wrap_policy(model: nn.Module) -> ModuleWrapPolicy:
    """`ModuleWrapPolicy` over the model's decoder-layer classes, for `TorchFSDPPlugin(auto_wrap_policy=...)`."""
    return ModuleWrapPolicy(set(block_classes(model)))
