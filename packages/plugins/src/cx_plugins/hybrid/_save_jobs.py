"""A hybrid checkpoint save in two halves: its preparation and its write job.

The preparation runs on the training thread, collectively over the world: the stage plan, the optimizer's
description and, for an asynchronous save (`copy`), every TP / ep gather too, into private CPU copies, so training may
change the live tensors as soon as the save returns. It returns the write job, which streams the tensors into a
folder with `write_sharded` over the group it is given: the world, now, or the writer threads' own group later. The
same job writes both ways, so an asynchronous save's files are byte-identical to a synchronous one's. A one-file save
writes its parts into a folder first; `merge_model` / `merge_optimizer` turn them into the file on the master rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_checkpoint import (
    CheckpointKind,
    CheckpointReader,
    FileFormat,
    GeneralCheckpointIO,
    OptimizerMeta,
    file_names,
    hf_side_files,
    optimizer_tensor_name,
    write_sharded,
    write_side_files,
)
from cx_mesh import ProcessGroup
from cx_plugins._layout import Axis
from cx_plugins.checkpoint_io._expert_shards import ExpertParallelShards
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.checkpoint_io._replicated import StateView, with_scaler
from cx_plugins.checkpoint_io._stage_names import StagePlan
from cx_plugins.hybrid._stage_agreement import merge_descriptions, require_same_entries
from cx_plugins.hybrid._stage_tensors import stage_tensors, state_tensors

__all__ = ["WriteJob", "merge_model", "merge_optimizer", "model_save", "optimizer_save"]

WriteJob = Callable[[Path, ProcessGroup], None]
"""Writes a prepared save into a folder (sharded), collectively over the group given."""


def _held(stream: Iterable[tuple[str, torch.Tensor]], copy: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """With `copy` the stream is run now (its gathers are collectives of the training thread's groups); else it runs
    as the job writes, one tensor at a time."""
    return list(stream) if copy else stream


def model_save(
    view: ParallelModelView,
    tp: ExpertParallelShards,
    model_dtype: torch.dtype | None,
    prefix: str | None,
    size_per_shard: float,
    use_safetensors: bool,
    copy: bool,
) -> WriteJob:
    plan = StagePlan.build(view)  # collective over the pipeline group
    tensors = _held(stage_tensors(plan, tp, model_dtype, copy=copy), copy)
    side = hf_side_files(view.unwrap())
    file_format = FileFormat.SAFETENSORS if use_safetensors else FileFormat.BIN

    def write(directory: Path, group: ProcessGroup) -> None:
        write_sharded(
            directory,
            tensors,
            kind=CheckpointKind.MODEL,
            file_format=file_format,
            size_per_shard=size_per_shard,
            prefix=prefix,
            group=group,
            extra_files=lambda staging: write_side_files(staging, side),
        )

    return write


def optimizer_save(
    view: ParallelModelView,
    face: ParallelOptimizerView,
    tp: ExpertParallelShards,
    optimizer_class: str | None,
    prefix: str | None,
    size_per_shard: float,
    copy: bool,
) -> WriteJob:
    state_dict = face.state_dict_by_name()  # collective over the data-parallel group
    plan = StagePlan.build(view)
    state: dict[str, dict[str, Any]] = state_dict.get("state", {})
    order = [name for name, _, _ in plan.entries if name in state]
    require_same_entries(view.layout.rank(Axis.PP), state, order, plan.gathers)
    described = {
        name: {
            key: {"tensor": optimizer_tensor_name(name, key)} if isinstance(value, torch.Tensor) else {"value": value}
            for key, value in state[name].items()
        }
        for index, name in enumerate(order)
        if plan.writes(index)
    }
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "param_names": [str(n) for n in group["params"]]}
        for group in state_dict.get("param_groups", [])
    ]
    mine = OptimizerMeta(groups, described) if plan.gathers else None
    meta = merge_descriptions(mine, list(dict(view.unwrap().named_parameters())))
    meta = with_scaler(dataclasses.replace(meta, optimizer_class=optimizer_class), state_dict.get("grad_scaler"))
    json_name = file_names(CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS, prefix).optimizer_json
    text = meta.to_json()
    tensors = _held(state_tensors(plan, tp, state, order, copy=copy), copy)

    def write(directory: Path, group: ProcessGroup) -> None:
        write_sharded(
            directory,
            tensors,
            kind=CheckpointKind.OPTIMIZER,
            size_per_shard=size_per_shard,
            prefix=prefix,
            group=group,
            extra_files=lambda staging: (staging / json_name).write_text(text),
        )

    return write


# The single files are written by a CheckpointIO of their own: the hybrid IO's own `_run` would first wait for its
# writer, which is the thread running an asynchronous merge.
def merge_model(owner: nn.Module, gather_dtensor: bool, use_safetensors: bool) -> Callable[[Path, Path], None]:
    """Read the parts folder into one model file (on the master rank: one file means one rank holds every tensor)."""

    def merge(parts: Path, checkpoint: Path) -> None:
        with CheckpointReader.open(parts, CheckpointKind.MODEL) as reader:
            state = {name: reader.read(name).clone() for name in reader.names()}
        GeneralCheckpointIO().save_unsharded_model(
            StateView(state, owner), checkpoint, gather_dtensor, use_safetensors, False
        )

    return merge


def merge_optimizer(parts: Path, checkpoint: Path) -> None:
    """Read the parts folder into one optimizer file (on the master rank)."""
    io = GeneralCheckpointIO()
    meta, tensors = io.load_optimizer_parts(parts)
    io.save_optimizer_parts(meta, {name: tensor.clone() for name, tensor in tensors.items()}, checkpoint, shard=False)
