"""Optimizer state keyed by parameter NAME: tensors as `state.<param name>.<key>`, everything else as JSON.

`OptimizerMeta` is the JSON part (`optimizer.json`, or the `cx_optimizer` header entry of an unsharded file): the
param groups' hyper-parameters with their parameter names, and for each parameter its state keys, each either a
tensor name or a plain value. Names come from `param_names` in each param group, which torch records when an
optimizer is built from `model.named_parameters()`; `attach_param_names` adds them to an optimizer built otherwise.
Restoring maps names to the current optimizer's parameters, so parameter order and integer ids never matter.

An optimizer whose groups carry no names (built from `model.parameters()`, the common case) is saved keyed by
POSITION instead (`keyed_by: "position"`, torch's own integer order): it loads back into the same optimizer layout,
and is refused with a clear error wherever names are needed (`require_names`). Every description also records the
optimizer's class and the shape of each parameter, so a load into another kind of optimizer or another model shape
fails at load time with a message, not later inside `step()`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from cx_checkpoint._errors import CheckpointError, CheckpointKindError, KeyMismatchError, TensorMismatchError
from cx_checkpoint._json_codec import decode, encode, parse_json
from cx_checkpoint._module import full_state

__all__ = [
    "OPTIMIZER_FORMAT",
    "OptimizerMeta",
    "ParamKey",
    "attach_param_names",
    "optimizer_param_names",
    "optimizer_tensor_name",
    "check_optimizer_class",
    "optimizer_class_name",
    "require_names",
    "restore_optimizer",
    "split_optimizer",
]

OPTIMIZER_FORMAT = "cx-optimizer/1"


class ParamKey(Enum):
    """What the state of an optimizer checkpoint is keyed by."""

    NAME = "name"
    """Parameter names (canonical: loads under any plugin, layout and parameter order)."""
    POSITION = "position"
    """torch's integer positions over all groups (the optimizer had no names): loads into the same layout only."""


def optimizer_class_name(optimizer: torch.optim.Optimizer) -> str:
    """`module.QualName` of the optimizer's class, as recorded in a description (`torch.optim.adamw.AdamW`)."""
    kind = type(optimizer)
    return f"{kind.__module__}.{kind.__qualname__}"


def _has_names(optimizer: torch.optim.Optimizer) -> bool:
    return all(
        group.get("param_names") is not None and len(group["param_names"]) == len(group["params"])
        for group in optimizer.param_groups
    )


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
    """param key -> state key -> `{"tensor": <tensor name>}` or `{"value": <plain value>}`."""
    keyed_by: ParamKey = ParamKey.NAME
    """NAME: groups carry `param_names` and state is keyed by name; POSITION: groups carry `param_count` and state
    is keyed by the decimal position (as in torch's own state dict)."""
    optimizer_class: str | None = None
    """`optimizer_class_name` of the optimizer that saved it (None: not recorded, e.g. a ZeRO plugin's state)."""
    param_shapes: dict[str, list[int]] = field(default_factory=dict)
    """param key -> the parameter's shape at save time (empty: not recorded)."""

    def to_json(self) -> str:
        groups = [encode(group, f"param_groups[{i}]") for i, group in enumerate(self.param_groups)]
        state = {
            param: {
                key: entry if "tensor" in entry else {"value": encode(entry["value"], f"state[{param!r}][{key!r}]")}
                for key, entry in entries.items()
            }
            for param, entries in self.state.items()
        }
        data: dict[str, Any] = {
            "format": OPTIMIZER_FORMAT,
            "keyed_by": self.keyed_by.value,
            "param_groups": groups,
            "state": state,
        }
        if self.optimizer_class is not None:
            data["optimizer_class"] = self.optimizer_class
        if self.param_shapes:
            data["param_shapes"] = self.param_shapes
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> OptimizerMeta:
        data = parse_json(text, where, CheckpointError, "optimizer JSON")
        if not isinstance(data, dict) or data.get("format") != OPTIMIZER_FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise CheckpointKindError(
                f"{where}: not a cx optimizer description (format {found!r}, expected {OPTIMIZER_FORMAT!r})"
            )
        try:
            keyed_by = ParamKey(data.get("keyed_by", ParamKey.NAME.value))
            groups = [decode(group) for group in data["param_groups"]]
            state = {
                str(param): {
                    str(key): entry if "tensor" in entry else {"value": decode(entry["value"])}
                    for key, entry in entries.items()
                }
                for param, entries in data["state"].items()
            }
            shapes = {str(k): [int(d) for d in v] for k, v in data.get("param_shapes", {}).items()}
            kind = data.get("optimizer_class")
        except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as error:
            raise CheckpointError(
                f"{where}: malformed cx optimizer description ({type(error).__name__}: {error})"
            ) from error
        return cls(groups, state, keyed_by, None if kind is None else str(kind), shapes)


def split_optimizer(
    optimizer: torch.optim.Optimizer, gather_dtensor: bool
) -> tuple[OptimizerMeta, dict[str, torch.Tensor]]:
    """The optimizer's JSON description and its state tensors by name (DTensors gathered).

    Keyed by parameter name when the optimizer knows its names, else by position (`ParamKey.POSITION`)."""
    keyed_by = ParamKey.NAME if _has_names(optimizer) else ParamKey.POSITION
    if keyed_by is ParamKey.NAME:
        names = optimizer_param_names(optimizer)
    else:
        names, start = [], 0
        for group in optimizer.param_groups:
            names.append([str(start + i) for i in range(len(group["params"]))])
            start += len(group["params"])
    shapes: dict[str, list[int]] = {}
    groups: list[dict[str, Any]] = []
    state: dict[str, dict[str, dict[str, Any]]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for number, (group, group_names) in enumerate(zip(optimizer.param_groups, names, strict=True)):
        hyper = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        encode(hyper, f"optimizer param_groups[{number}]")  # refuse unstorable values now, naming them
        if keyed_by is ParamKey.NAME:
            groups.append({**hyper, "param_names": group_names})
        else:
            groups.append({**hyper, "param_count": len(group_names)})
        for parameter, name in zip(group["params"], group_names, strict=True):
            shapes[name] = list(parameter.shape)
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
    return OptimizerMeta(groups, state, keyed_by, optimizer_class_name(optimizer), shapes), tensors


def require_names(meta: OptimizerMeta, where: str) -> None:
    """A clear error when a position-keyed description reaches code that matches parameters by name."""
    if meta.keyed_by is not ParamKey.NAME:
        raise CheckpointKindError(
            f"{where}: this optimizer checkpoint is keyed by parameter POSITION (it was saved from an optimizer "
            "without parameter names, e.g. built from model.parameters()), so it loads only into the same plain "
            "optimizer layout; this load matches parameters by name. Re-save it from an optimizer that knows its "
            "names (build it from model.named_parameters(), call cx_checkpoint.attach_param_names(optimizer, model), "
            "or save through the Booster)"
        )


def check_optimizer_class(meta: OptimizerMeta, optimizer: torch.optim.Optimizer, where: str) -> None:
    """Refuse (`CheckpointKindError`) state saved by another optimizer class than `optimizer`'s, before anything is
    loaded: another optimizer's state (AdamW's moments into SGD with momentum) would otherwise be accepted and fail
    later inside `step()` with a bare `KeyError`. A description without `optimizer_class` passes."""
    kind = optimizer_class_name(optimizer)
    if meta.optimizer_class is not None and meta.optimizer_class != kind:
        raise CheckpointKindError(
            f"{where}: optimizer state saved by {meta.optimizer_class}, loading into {kind}: their state differs "
            "(load it into the same kind of optimizer)"
        )


def restore_optimizer(
    optimizer: torch.optim.Optimizer,
    meta: OptimizerMeta,
    read: Callable[[str], torch.Tensor],
    where: str,
) -> None:
    """Load `meta` plus tensors from `read(tensor name)` into `optimizer`, matching parameters by name (or, for a
    position-keyed checkpoint, by position). Checks the optimizer's class and every parameter's shape first."""
    check_optimizer_class(meta, optimizer, where)
    if meta.keyed_by is ParamKey.NAME:
        if not _has_names(optimizer):
            optimizer_param_names(optimizer)  # raises, saying how to give the optimizer its names
        names = optimizer_param_names(optimizer)
        saved_names = [list(saved.get("param_names", [])) for saved in meta.param_groups]
    else:
        saved_names = []
        start = 0
        for saved in meta.param_groups:
            count = int(saved.get("param_count", -1))
            saved_names.append([str(start + i) for i in range(count)])
            start += max(count, 0)
        names = []
        start = 0
        for group in optimizer.param_groups:
            names.append([str(start + i) for i in range(len(group["params"]))])
            start += len(group["params"])
    if len(meta.param_groups) != len(names):
        raise KeyMismatchError(
            f"{where}: the checkpoint has {len(meta.param_groups)} param group(s), the optimizer {len(names)}", [], []
        )
    position: dict[str, int] = {}
    parameters: dict[str, torch.Tensor] = {}
    for group_names, group in zip(names, optimizer.param_groups, strict=True):
        for name, parameter in zip(group_names, group["params"], strict=True):
            position[name] = len(position)
            parameters[name] = parameter
    saved_groups = []
    for number, (saved, saved_group_names, current) in enumerate(
        zip(meta.param_groups, saved_names, names, strict=True)
    ):
        if set(saved_group_names) != set(current):
            how = "other parameters" if meta.keyed_by is ParamKey.NAME else "another number of parameters"
            raise KeyMismatchError(
                f"{where}: param group {number} holds {how} than the optimizer's"
                + ("" if meta.keyed_by is ParamKey.NAME else " (a position-keyed checkpoint needs the same layout)"),
                missing=set(current) - set(saved_group_names),
                unexpected=set(saved_group_names) - set(current),
            )
        group = {key: value for key, value in saved.items() if key not in ("param_names", "param_count")}
        group["params"] = [position[name] for name in current]
        if "param_names" in optimizer.param_groups[number]:
            group["param_names"] = list(optimizer.param_groups[number]["param_names"])
        saved_groups.append(group)
    for name, shape in meta.param_shapes.items():
        if name in parameters and list(parameters[name].shape) != list(shape):
            raise TensorMismatchError(
                f"{where}: parameter {name!r} had shape {list(shape)} when this optimizer state was saved, but is "
                f"{list(parameters[name].shape)} now"
            )
    state: dict[int, dict[str, Any]] = {}
    for name, entries in meta.state.items():
        if name not in position:
            raise KeyMismatchError(f"{where}: optimizer state for unknown parameter", [], [name])
        values = {key: read(entry["tensor"]) if "tensor" in entry else entry["value"] for key, entry in entries.items()}
        _check_state_shapes(name, parameters[name], values, where)
        state[position[name]] = values
    optimizer.load_state_dict({"state": state, "param_groups": saved_groups})


def _check_state_shapes(name: str, parameter: torch.Tensor, values: Mapping[str, Any], where: str) -> None:
    """Element-wise state (a tensor with as many dimensions as its parameter) must have the parameter's shape."""
    for key, value in values.items():
        elementwise = isinstance(value, torch.Tensor) and value.dim() > 0 and value.dim() == parameter.dim()
        if elementwise and value.shape != parameter.shape:
            raise TensorMismatchError(
                f"{where}: optimizer state {key!r} of parameter {name!r} has shape {list(value.shape)}, but the "
                f"parameter has shape {list(parameter.shape)}"
            )


def describe_tensors(meta: OptimizerMeta) -> Mapping[str, str]:
    """tensor name -> parameter name, for every tensor `meta` refers to."""
    return {
        entry["tensor"]: param
        for param, entries in meta.state.items()
        for entry in entries.values()
        if "tensor" in entry
    }
