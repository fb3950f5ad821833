"""Flatten the values that travel between stages (dicts, lists, tuples of tensors and plain constants) into tensor
leaves plus a JSON-serialisable structure, and back.

Our own small pytree (rather than torch's private `torch.utils._pytree`) because the structure must cross process
boundaries as JSON bytes in a tensor: no pickle, no numpy, identical on every torch version we accept.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["TensorMeta", "TreeMeta", "flatten", "unflatten"]

_CONSTANTS = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and whether a leaf carries a gradient back."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool  # floating-point leaves carry a gradient back, whatever their requires_grad on the sender


@dataclass(frozen=True)
class TreeMeta:
    """Everything a receiver needs to allocate buffers and rebuild the value: structure plus per-leaf metadata."""

    structure: Any  # JSON-able nested description; tensors appear as {"t": index}
    leaves: tuple[TensorMeta, ...]

    def to_bytes(self) -> bytes:
        leaves = [[list(m.shape), str(m.dtype).removeprefix("torch."), m.requires_grad] for m in self.leaves]
        return json.dumps({"s": self.structure, "l": leaves}, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes) -> TreeMeta:
        raw = json.loads(data.decode())
        leaves = tuple(TensorMeta(tuple(shape), getattr(torch, dtype), bool(rg)) for shape, dtype, rg in raw["l"])
        return TreeMeta(raw["s"], leaves)


def _describe(value: Any, leaves: list[torch.Tensor], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return {"t": len(leaves) - 1}
    if isinstance(value, Mapping):
        keys = list(value)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"{where}: dictionary keys must be strings to travel between stages, got {keys}")
        return {"d": keys, "c": [_describe(value[k], leaves, f"{where}[{k!r}]") for k in keys]}
    if isinstance(value, list | tuple):
        kind = "l" if isinstance(value, list) else "u"
        return {kind: [_describe(v, leaves, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, _CONSTANTS):
        return {"v": value}
    raise TypeError(
        f"{where}: a {type(value).__name__} cannot travel between pipeline stages; use tensors, dicts, lists, "
        "tuples and plain constants (None, bool, int, float, str)"
    )


def flatten(value: Any, where: str = "value") -> tuple[list[torch.Tensor], TreeMeta]:
    """Tensor leaves in a fixed order, and the metadata that rebuilds `value` from them."""
    leaves: list[torch.Tensor] = []
    structure = _describe(value, leaves, where)
    metas = tuple(TensorMeta(tuple(t.shape), t.dtype, t.is_floating_point()) for t in leaves)
    return leaves, TreeMeta(structure, metas)


def _build(structure: Any, leaves: list[torch.Tensor]) -> Any:
    if "t" in structure:
        return leaves[structure["t"]]
    if "d" in structure:
        return {k: _build(c, leaves) for k, c in zip(structure["d"], structure["c"], strict=True)}
    if "l" in structure:
        return [_build(c, leaves) for c in structure["l"]]
    if "u" in structure:
        return tuple(_build(c, leaves) for c in structure["u"])
    return structure["v"]


def unflatten(meta: TreeMeta, leaves: list[torch.Tensor]) -> Any:
    """The value `flatten` described, with `leaves` in place of its tensors."""
    if len(leaves) != len(meta.leaves):
        raise ValueError(f"{len(leaves)} tensors for a structure of {len(meta.leaves)}")
    return _build(meta.structure, leaves)
