"""Adapters "this stage owns these parameters" and "one writer per tensor" for checkpoints of a model split over
pipeline stages and replicated over data-parallel ranks.

Each pipeline stage writes only the parameters and buffers it holds; a tensor held by several stages (a tied
embedding / head) is written by the first of them. Within a stage, the ranks of one ep x tp block gather the shards
(every one of them takes part in the TP gathers and, for expert slices, the ep gathers, and each ends up with the
full tensor) and they take turns writing them (tensor i of the stage by the block's rank i mod ep*tp), so the write
bandwidth is spread; every other replica (data-parallel, moe-dp, sequence-parallel ranks) stays out. Tied
parameters are written under each of their names, as the module's `state_dict()` has them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from cx_mesh import all_gather_bytes
from cx_plugins._layout import Axis, ParallelLayout
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView

__all__ = ["StagePlan", "module_tensor_names", "persistent_buffers"]


def persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of every persistent buffer, as the module's `state_dict()` would name it."""
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Canonical parameter name (first occurrence) -> every name of that parameter."""
    first: dict[int, str] = {}
    names: dict[str, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        canonical = first.setdefault(id(param), name)
        names.setdefault(canonical, []).append(name)
    return names


def module_tensor_names(module: nn.Module) -> set[str]:
    """Every name the module's `state_dict()` holds (parameters under all their names, persistent buffers),
    without calling `state_dict()` (a collective for TP layers)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    return params | {name for name, _ in persistent_buffers(module)}


@dataclass(frozen=True)
class StagePlan:
    """What this rank does in a save: `entries` (canonical name, tensor, names written) in an order shared by the
    ep x tp block; `gathers`: this rank takes part in the TP / ep gathers; it writes entry i when `writes(i)`."""

    entries: tuple[tuple[str, torch.Tensor, tuple[str, ...]], ...]
    gathers: bool
    turn: int
    turns: int

    def writes(self, index: int) -> bool:
        """Whether this rank writes the `index`-th tensor of its stage (the ep x tp ranks take turns)."""
        return self.gathers and index % self.turns == self.turn

    @classmethod
    def build(cls, view: ParallelModelView) -> StagePlan:
        """Collective over the pipeline group (the held names of the stages are exchanged)."""
        layout = view.layout
        module = view.unwrap()
        held_params = view.held_parameter_names()
        held_buffers = view.held_buffer_names()
        mine = _first_holder(layout, sorted(held_params | held_buffers))
        aliases = _aliases(module)
        params = dict(module.named_parameters())
        entries: list[tuple[str, torch.Tensor, tuple[str, ...]]] = []
        for name, param in params.items():
            if name in held_params and name in mine:
                entries.append((name, param, tuple(aliases.get(name, [name]))))
        for name, buffer in persistent_buffers(module):
            if name in held_buffers and name in mine:
                entries.append((name, buffer, (name,)))
        replica_axes = [a for a in layout.axes if a not in (Axis.PP, Axis.EP, Axis.TP)]
        gathers = layout.rank(*replica_axes) == 0
        return cls(tuple(entries), gathers, layout.rank(Axis.EP, Axis.TP), layout.size(Axis.EP, Axis.TP))


def _first_holder(layout: ParallelLayout, held: list[str]) -> set[str]:
    """The names among `held` that no earlier pipeline stage holds (collective over the pipeline group)."""
    group = layout.group_or_none(Axis.PP)
    if group is None:
        return set(held)
    stage = layout.rank(Axis.PP)
    earlier: set[str] = set()
    for number, raw in enumerate(all_gather_bytes(json.dumps(held).encode(), group)):
        if number < stage:
            earlier.update(json.loads(raw))
    return set(held) - earlier
