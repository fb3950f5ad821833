"""Optimizer state keyed by parameter NAME: tensors as `state.<param name>.<key>`, everything else as JSON.

`OptimizerMeta` is the JSON part (`optimizer.json`, or the `cx_optimizer` header entry of an unsharded file): the
param groups' hyper-parameters with their parameter names, and for each parameter its state keys, each either a
tensor name or a plain value. Names come from `param_names` in each param group, which torch records when an
optimizer is built from `model.named_parameters()`; `attach_param_names` adds them to an optimizer built otherwise.
Restoring maps names to the current optimizer's parameters, so parameter order and integer ids never matter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cx_checkpoint._errors import CheckpointError, CheckpointKindError, KeyMismatchError
from cx_checkpoint._json_codec import decode, encode
from cx_checkpoint._module import full_state

__all__ = [
    "OPTIMIZER_FORMAT",
    "OptimizerMeta",
    "attach_param_names",
    "optimizer_param_names",
    "optimizer_tensor_name",
    "restore_optimizer",
    "split_optimizer",
]

OPTIMIZER_FORMAT = "cx-optimizer/1"


def optimizer_tensor_name(param_name: str, key: str) -> str:
    """The tensor name under which state `key` of parameter `param_name` is stored."""
    return f"state.{param_name}.{key}"


def attach_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Record each optimizer parameter's name in `model` as `param_names` in its param group (torch's own field)."""
    names: dict[torch.Tensor, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(parameter, name)
    for number, group in enumerate(optimizer.param_groups):
        missing = [i for i, p in enumerate(group["params"]) if p not in names]
        if missing:
            raise ValueError(f"param group {number}: parameters at positions {missing} are not parameters of the model")
        group["param_names"] = [names[p] for p in group["params"]]


def optimizer_param_names(optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each param group; a clear error when the optimizer does not know them."""
    result: list[list[str]] = []
    seen: set[str] = set()
    for number, group in enumerate(optimizer.param_groups):
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise ValueError(
                f"optimizer param group {number} has no parameter names; cx checkpoints key optimizer state by "
                "parameter name: build the optimizer from model.named_parameters() or call "
                "cx_checkpoint.attach_param_names(optimizer, model) first"
            )
        duplicated = seen.intersection(names)
        if duplicated:
            raise ValueError(f"parameter names {sorted(duplicated)} appear in more than one param group")
        seen.update(names)
        result.append([str(name) for name in names])
    return result


@dataclass(frozen=True)
class OptimizerMeta:
    """The non-tensor part of an optimizer checkpoint."""

    param_groups: list[dict[str, Any]]
    """Hyper-parameters of each group plus `param_names` (no `params`)."""
    state: dict[str, dict[str, dict[str, Any]]]
    """param name -> state key -> `{"tensor": <tensor name>}` or `{"value": <plain value>}`."""

    def to_json(self) -> str:
        groups = [encode(group, f"param_groups[{i}]") for i, group in enumerate(self.param_groups)]
        state = {
            param: {
                key: entry if "tensor" in entry else {"value": encode(entry["value"], f"state[{param!r}][{key!r}]")}
                for key, entry in entries.items()
            }
            for param, entries in self.state.items()
        }
        return json.dumps({"format": OPTIMIZER_FORMAT, "param_groups": groups, "state": state}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> OptimizerMeta:
        try:
            data = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{where}: optimizer JSON does not parse: {error}") from error
        if not isinstance(data, dict) or data.get("format") != OPTIMIZER_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointKindError(
                f"{where}: not a cx optimizer description (format {found!r}, expected {OPTIMIZER_FORMAT!r})"
            )
        groups = [decode(group) for group in data["param_groups"]]
        state = {
            param: {
                key: entry if "tensor" in entry else {"value": decode(entry["value"])} for key, entry in entries.items()
            }
            for param, entries in data["state"].items()
        }
        return cls(groups, state)


def split_optimizer(
    optimizer: torch.optim.Optimizer, gather_dtensor: bool
) -> tuple[OptimizerMeta, dict[str, torch.Tensor]]:
    """The optimizer's JSON description and its state tensors by name (DTensors gathered)."""
    names = optimizer_param_names(optimizer)
    groups: list[dict[str, Any]] = []
    state: dict[str, dict[str, dict[str, Any]]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for number, (group, group_names) in enumerate(zip(optimizer.param_groups, names, strict=True)):
        hyper = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        encode(hyper, f"optimizer param_groups[{number}]")  # refuse unstorable values now, naming them
        groups.append({**hyper, "param_names": group_names})
        for parameter, name in zip(group["params"], group_names, strict=True):
            entries: dict[str, dict[str, Any]] = {}
            param_tensors: dict[str, torch.Tensor] = {}
            for key, value in optimizer.state.get(parameter, {}).items():
                if isinstance(value, torch.Tensor):
                    param_tensors[optimizer_tensor_name(name, str(key))] = value
                    entries[str(key)] = {"tensor": optimizer_tensor_name(name, str(key))}
                else:
                    encode(value, f"optimizer state of {name!r}, key {key!r}")
                    entries[str(key)] = {"value": value}
            tensors.update(full_state(param_tensors, gather_dtensor, "optimizer state tensor"))
            if entries:
                state[name] = entries
    return OptimizerMeta(groups, state), tensors


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    meta: OptimizerMeta,
    read: Callable[[str], torch.Tensor],
    where: str,
) -> None:
    """Load `meta` plus tensors from `read(tensor name)` into `optimizer`, matching parameters by name."""
    names = optimizer_param_names(optimizer)
    if len(meta.param_groups) != len(names):
        raise KeyMismatchError(
            f"{where}: the checkpoint has {len(meta.param_groups)} param group(s), the optimizer {len(names)}", [], []
        )
    position: dict[str, int] = {}
    for group_names in names:
        for name in group_names:
            position[name] = len(position)
    saved_groups = []
    for number, (saved, current) in enumerate(zip(meta.param_groups, names, strict=True)):
        saved_names = list(saved.get("param_names", []))
        if set(saved_names) != set(current):
            raise KeyMismatchError(
                f"{where}: param group {number} holds other parameters than the optimizer's",
                missing=set(current) - set(saved_names),
                unexpected=set(saved_names) - set(current),
            )
        group = {key: value for key, value in saved.items() if key != "param_names"}
        group["params"] = [position[name] for name in current]
        group["param_names"] = list(current)
        saved_groups.append(group)
    state: dict[int, dict[str, Any]] = {}
    for name, entries in meta.state.items():
        if name not in position:
            raise KeyMismatchError(f"{where}: optimizer state for unknown parameter", [], [name])
        state[position[name]] = {
            key: read(entry["tensor"]) if "tensor" in entry else entry["value"] for key, entry in entries.items()
        }
    optimizer.load_state_dict({"state": state, "param_groups": saved_groups})


def describe_tensors(meta: OptimizerMeta) -> Mapping[str, str]:
    """tensor name -> parameter name, for every tensor `meta` refers to."""
    return {
        entry["tensor"]: param
        for param, entries in meta.state.items()
        for entry in entries.values()
        if "tensor" in entry
    }
