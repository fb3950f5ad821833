"""Which optimizers may step on flat shards, and which need whole matrices.

ZeRO (LowLevelZero and Gemini) hands the wrapped optimizer 1-D slices of each parameter, and tensor parallelism
(HybridParallel) or FSDP hands it row or column slices, so an optimizer that looks at a whole matrix or a whole
parameter (Muon's Newton-Schulz orthogonalisation, factored second moments, per-parameter trust ratios as in
LAMB/LARS, line search, sparse gradients) would silently compute something else on them.

Three kinds:
- elementwise (`ELEMENTWISE_OPTIMIZERS`): may step on any slice;
- whole-tensor (`WHOLE_TENSOR_OPTIMIZERS`, torch's `Muon` and cx's `MuonWithAdamW`, or an instance the user passed
  to `declare_whole_tensor`):
  correct only when each parameter is stepped whole; an engine that can gather each parameter to one rank (see
  `_whole_step`) takes them, the others refuse them (`require_elementwise`);
- anything else: unknown, refused everywhere parameters are sliced, naming both lists and how to declare one.

A whole-tensor optimizer may mix kinds by param group (`MuonWithAdamW`: Muon groups need whole matrices, its AdamW
groups are elementwise): it says so per group through `GroupKinds`, and `elementwise_groups` reads that, so an engine
steps the elementwise groups on its shards (each rank 1/dp of their masters and states) and gathers only the rest.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from cx_zero._adam import CPUAdam, HybridAdam
from cx_zero._muon_adamw import MuonWithAdamW

__all__ = [
    "ELEMENTWISE_OPTIMIZERS",
    "WHOLE_TENSOR_OPTIMIZERS",
    "GroupKinds",
    "declare_whole_tensor",
    "elementwise_groups",
    "is_elementwise",
    "needs_whole_tensors",
    "require_elementwise",
    "require_elementwise_or_whole",
]

ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
    CPUAdam,
    HybridAdam,
)

WHOLE_TENSOR_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Muon, MuonWithAdamW)

_DECLARED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def declare_whole_tensor(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Mark `optimizer` as one whose update of a parameter needs the whole parameter (as Muon's does), so that the
    engines that can step whole parameters on one owner rank take it; returns it."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"declare_whole_tensor takes a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _DECLARED.add(optimizer)
    return optimizer


def is_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is (a subclass of) one known to update each element from that element alone."""
    return isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and optimizer not in _DECLARED


def needs_whole_tensors(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is known to need each parameter whole (Muon, or declared with `declare_whole_tensor`)."""
    return isinstance(optimizer, WHOLE_TENSOR_OPTIMIZERS) or optimizer in _DECLARED


@runtime_checkable
class GroupKinds(Protocol):
    """A whole-tensor optimizer whose param groups differ in kind: `param_group_is_elementwise(group)` is True for a
    group whose update of each element depends on that element alone (it may step on flat shards)."""

    def param_group_is_elementwise(self, group: Mapping[str, Any]) -> bool: ...


def elementwise_groups(optimizer: torch.optim.Optimizer) -> list[bool]:
    """Per param group of `optimizer`: whether it may step on flat shards. All True for an elementwise optimizer; for
    a whole-tensor one, what it says through `GroupKinds` (all False without it, or when declared whole-tensor with
    `declare_whole_tensor`, which covers the whole instance). TypeError for an unknown optimizer."""
    groups = optimizer.param_groups
    if is_elementwise(optimizer):
        return [True] * len(groups)
    if not needs_whole_tensors(optimizer):
        require_elementwise_or_whole(optimizer, "elementwise_groups")  # raises, naming both lists
    if optimizer in _DECLARED or not isinstance(optimizer, GroupKinds):
        return [False] * len(groups)
    return [bool(optimizer.param_group_is_elementwise(group)) for group in groups]


def _names(classes: tuple[type[torch.optim.Optimizer], ...]) -> str:
    return ", ".join(cls.__name__ for cls in classes)


def require_elementwise(optimizer: torch.optim.Optimizer, who: str) -> None:
    """Raise TypeError unless `optimizer` is elementwise (`who` slices parameters and cannot gather them whole)."""
    if is_elementwise(optimizer):
        return
    if needs_whole_tensors(optimizer):
        raise TypeError(
            f"{who}: {type(optimizer).__name__} needs each parameter whole (its update is matrix-wise, e.g. Muon's "
            f"Newton-Schulz orthogonalisation), and {who} steps on parameter slices, so it would silently compute "
            f"something else; use a plugin that steps whole matrices (docs/plugins.md, 'Matrix-wise optimizers') or "
            f"an elementwise optimizer: {_names(ELEMENTWISE_OPTIMIZERS)}"
        )
    raise TypeError(
        f"{who}: {type(optimizer).__name__} is not known to be elementwise (its update of one element may depend on "
        f"others, e.g. factored, per-parameter or matrix-wise updates), so it cannot step on flat parameter shards; "
        f"accepted: {_names(ELEMENTWISE_OPTIMIZERS)}"
    )


def require_elementwise_or_whole(optimizer: torch.optim.Optimizer, who: str) -> bool:
    """For an engine that can step whole parameters on one rank: True for a whole-tensor optimizer, False for an
    elementwise one; TypeError for an unknown one (naming both lists and `declare_whole_tensor`)."""
    if is_elementwise(optimizer):
        return False
    if needs_whole_tensors(optimizer):
        return True
    raise TypeError(
        f"{who}: {type(optimizer).__name__} is not known to be elementwise (its update of one element may depend on "
        f"others, e.g. factored, per-parameter or matrix-wise updates), so it cannot step on flat parameter shards; "
        f"accepted: {_names(ELEMENTWISE_OPTIMIZERS)}; an optimizer that needs each parameter whole (as "
        f"{_names(WHOLE_TENSOR_OPTIMIZERS)} does) is accepted once passed to cx_zero.declare_whole_tensor"
    )
