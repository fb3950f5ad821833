"""The tensors of one pipeline stage as `HybridCheckpointIO` streams them out (gathered over tp / ep, written by
their stage's turn-taking writer) and receives them back (cut to this rank's slice)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from cx_checkpoint import Region, TensorSpec, optimizer_tensor_name
from cx_plugins.checkpoint_io._expert_shards import ExpertParallelShards
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView
from cx_plugins.checkpoint_io._stage_names import StagePlan, persistent_buffers

__all__ = ["StageSink", "stage_tensors", "state_tensors", "stored_dtype"]


class StageSink:
    """`TensorSink` over the tensors one pipeline stage holds, in their local (TP-sharded) shapes."""

    def __init__(self, view: ParallelModelView, model_dtype: torch.dtype | None) -> None:
        self._dtype = model_dtype
        module = view.unwrap()
        held = view.held_parameter_names()
        buffers = view.held_buffer_names()
        first: dict[int, str] = {}
        self._targets: dict[str, torch.Tensor] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if first.setdefault(id(param), name) in held:
                self._targets[name] = param
        for name, buffer in persistent_buffers(module):
            if name in buffers:
                self._targets[name] = buffer

    def expected_tensors(self) -> dict[str, TensorSpec]:
        return {name: TensorSpec(tuple(t.shape), stored_dtype(t, self._dtype)) for name, t in self._targets.items()}

    def owned_region(self, name: str) -> Region | None:
        return None

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self._targets[name].copy_(tensor)  # cast back to the training dtype


def stored_dtype(tensor: torch.Tensor, model_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a model tensor has in the checkpoint: the model's own for floating tensors when given."""
    return model_dtype if model_dtype is not None and tensor.is_floating_point() else tensor.dtype


def stage_tensors(
    plan: StagePlan, tp: ExpertParallelShards, model_dtype: torch.dtype | None, copy: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's stream: the TP / ep gathers of its stage's tensors (on every rank of the writing ep x tp block), each
    yielded by its writer under every name of the tensor (copies, since writers refuse shared storage). With `copy`
    every tensor yielded is a private copy, never the live parameter itself (an asynchronous save keeps them)."""
    if not plan.gathers:
        return
    with torch.no_grad():
        for index, (name, tensor, names) in enumerate(plan.entries):
            full = tp.gather(name, tensor.detach())
            if not plan.writes(index):
                continue
            on_cpu = full.detach().to("cpu", stored_dtype(full, model_dtype), copy=copy).contiguous()
            for number, alias in enumerate(names):
                yield alias, on_cpu if number == 0 else on_cpu.clone()


def state_tensors(
    plan: StagePlan, tp: ExpertParallelShards, state: dict[str, dict[str, Any]], order: list[str], copy: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """The same for the optimizer state of the stage's parameters, by `optimizer_tensor_name`."""
    if not plan.gathers:
        return
    for index, name in enumerate(order):
        for key, value in sorted(state[name].items()):
            if not isinstance(value, torch.Tensor):
                continue
            tensor_name = optimizer_tensor_name(name, key)
            full = tp.gather(tensor_name, value.detach())
            if plan.writes(index):
                yield tensor_name, full.detach().to("cpu", copy=copy).contiguous()
