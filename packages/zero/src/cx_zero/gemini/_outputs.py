"""The tensors inside a module's inputs and outputs, whatever their structure.

GeminiDDP registers the backward re-gather of a unit on the tensors its forward returned, and decides whether a
forward ends the step from whether its output needs a gradient; both must see every tensor. torch's pytree knows
tensors, lists, tuples (named ones too), dicts and every type registered with it (Hugging Face's `ModelOutput`
is); dataclasses that are not registered are walked through their fields here. When an output shows no tensor
that needs a gradient but holds one inside anything else (an object pytree sees as one opaque leaf), backward would
reach the unit without gathering it again: that is an error naming the type, instead of a failure deep inside
autograd. (Outputs that show such a tensor are not searched further: the backward hook registered on them is enough,
and objects carried alongside, such as a key/value cache, are left alone.)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["OpaqueOutputError", "grad_tensors_in", "map_tensors", "tensors_in"]

_PLAIN = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size, type)


class OpaqueOutputError(TypeError):
    """A tensor that needs a gradient is held by a structure whose contents neither pytree nor dataclass fields
    expose."""


def _is_dataclass_instance(value: object) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def tensors_in(value: object) -> list[torch.Tensor]:
    """Every tensor pytree or dataclass fields reach in `value`."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect(value, found, set())
    return found


def _collect(value: object, found: list[torch.Tensor], seen: set[int]) -> None:
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif _is_dataclass_instance(leaf) and id(leaf) not in seen:
            seen.add(id(leaf))
            for field in dataclasses.fields(leaf):
                _collect(getattr(leaf, field.name), found, seen)


def grad_tensors_in(value: object, producer: str) -> list[torch.Tensor]:
    """The tensors in `value` that require a gradient. When there is none, raises `OpaqueOutputError` naming
    `producer` and the type if one is hidden in a structure neither pytree nor dataclass fields see (one attribute
    level is looked at)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.requires_grad else []
    visible = [t for t in tensors_in(value) if t.requires_grad]
    if visible:
        return visible
    for leaf in _opaque_leaves(value, set()):
        hidden = [t for item in vars(leaf).values() for t in tensors_in(item) if t.requires_grad]
        if hidden:
            kind = f"{type(leaf).__module__}.{type(leaf).__qualname__}"
            raise OpaqueOutputError(
                f"GeminiDDP: module {producer!r} returned a {kind} holding tensors that need a gradient, but torch's "
                "pytree cannot see inside it, so its parameters could not be gathered again for backward. Return "
                "tensors, lists, tuples, dicts or dataclasses, or register the type with "
                "torch.utils._pytree.register_pytree_node (or register_dataclass)"
            )
    return []


def _opaque_leaves(value: object, seen: set[int]) -> list[Any]:
    out = []
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, (torch.Tensor, _PLAIN)) or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        if _is_dataclass_instance(leaf):
            for field in dataclasses.fields(leaf):
                out.extend(_opaque_leaves(getattr(leaf, field.name), seen))
        elif hasattr(leaf, "__dict__"):
            out.append(leaf)
    return out


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """`value` with `fn` applied to every tensor pytree or dataclass fields reach (same structure and types)."""
    if isinstance(value, torch.Tensor):
        return fn(value)

    def leaf(item: Any) -> Any:
        if isinstance(item, torch.Tensor):
            return fn(item)
        if _is_dataclass_instance(item):
            changes = {f.name: map_tensors(fn, getattr(item, f.name)) for f in dataclasses.fields(item) if f.init}
            return dataclasses.replace(item, **changes)
        return item

    return pytree.tree_map(leaf, value)
