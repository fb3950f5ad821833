"""What every rank must agree on when it boosts: the plugin, the Booster's precision, and the optimizer's kind and
hyper-parameters. A rank with another learning rate or precision would otherwise train and drift silently (nothing
in the collectives notices); comparing them at `boost` turns that into an error naming the differing field."""

from __future__ import annotations

import dataclasses
import numbers

import torch
from torch.optim import Optimizer

from cx_mesh import assert_same_across_ranks

__all__ = ["BoostSettings", "check_boost_settings"]


@dataclasses.dataclass(frozen=True)
class BoostSettings:
    plugin: str
    mixed_precision: str
    optimizer: str | None
    param_groups: tuple[dict[str, object], ...]


def _plain(value: object) -> object:
    """A hyper-parameter as plain data: 0-d tensors (a tensor lr) by value, containers element-wise."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else tuple(value.flatten().tolist())
    if isinstance(value, tuple | list):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, str | bool | numbers.Number):
        return value
    return type(value).__name__  # objects (e.g. a custom callable) are compared by kind only


def boost_settings(plugin: object, mixed_precision: str, optimizer: Optimizer | None) -> BoostSettings:
    groups = tuple(
        {key: _plain(value) for key, value in sorted(group.items()) if key != "params"}
        | {"params (count)": len(group["params"])}
        for group in (optimizer.param_groups if optimizer is not None else ())
    )
    return BoostSettings(
        plugin=type(plugin).__name__,
        mixed_precision=mixed_precision,
        optimizer=type(optimizer).__name__ if optimizer is not None else None,
        param_groups=groups,
    )


def check_boost_settings(plugin: object, mixed_precision: str, optimizer: Optimizer | None) -> None:
    """Raise `RankMismatchError` on every rank unless all ranks boost with the same settings (collective)."""
    assert_same_across_ranks(boost_settings(plugin, mixed_precision, optimizer), what="Booster settings")
