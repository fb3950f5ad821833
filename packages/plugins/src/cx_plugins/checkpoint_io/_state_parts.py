"""A full optimizer state dict keyed by parameter name (a ZeRO optimizer's gathered state, FSDP's full one) as cx
optimizer parts (the JSON description and its tensors) and back: what the ZeRO and FSDP checkpoint IOs write and
read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cx_checkpoint import OptimizerMeta, optimizer_tensor_name
from cx_plugins.checkpoint_io._replicated import split_scaler, states_by_name, with_scaler

__all__ = ["zero_state_from_parts", "zero_state_to_parts"]


def zero_state_to_parts(state: Mapping[str, Any]) -> tuple[OptimizerMeta, dict[str, torch.Tensor]]:
    """A ZeRO optimizer's full state dict (by name) as cx optimizer parts."""
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "param_names": [str(n) for n in group["params"]]}
        for group in state["param_groups"]
    ]
    entries: dict[str, dict[str, dict[str, Any]]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, values in state["state"].items():
        described: dict[str, dict[str, Any]] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[optimizer_tensor_name(name, key)] = value
                described[key] = {"tensor": optimizer_tensor_name(name, key)}
            else:
                described[key] = {"value": value}
        entries[name] = described
    return with_scaler(OptimizerMeta(groups, entries), state.get("grad_scaler")), tensors


def zero_state_from_parts(meta: OptimizerMeta, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The inverse of `zero_state_to_parts` (also reads optimizers saved by the other plugins)."""
    meta, scaler = split_scaler(meta)
    groups = [
        {**{k: v for k, v in group.items() if k != "param_names"}, "params": list(group["param_names"])}
        for group in meta.param_groups
    ]
    result: dict[str, Any] = {"state": states_by_name(meta, tensors), "param_groups": groups}
    if scaler is not None:
        result["grad_scaler"] = scaler
    return result
