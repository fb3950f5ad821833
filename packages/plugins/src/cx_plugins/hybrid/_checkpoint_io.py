"""Checkpoint IO for models split by tensor and pipeline parallelism, in the canonical cx format.

Composition over cx-checkpoint's streaming writer and lazy reader:
- `TensorParallelShards` ("this tensor is a TP shard"): shards are gathered over the TP group on save (vocabulary
  padding stripped) and cut again on load;
- `ExpertParallelShards` ("this tensor is an expert slice", over the TP adapter): expert stacks split over an ep
  group are gathered along the expert dimension after the TP gather, and cut again on load;
- `StagePlan` ("this stage owns these parameters", "one writer per tensor"): each pipeline stage streams only the
  tensors it holds, its ep x tp ranks take turns writing them, the data-parallel replicas stay out;
- every rank calls `write_sharded` with its own tensors: the stages write their shard files in parallel into one
  staging directory, rank 0 merges one index (and the optimizer description) and commits atomically, and an error on
  any rank is raised on every rank. No rank ever holds more than its stage's tensors, one at a time.
The files are what `GeneralCheckpointIO` writes for the unsharded model: full tensors under the model's own (Hugging
Face) names, `config.json` beside them, so `from_pretrained`, every cx plugin and this IO at any tp / pp / dp / ep
layout load them. Optimizer state is by parameter name (`state.<param>.<key>`), gathered the same way.
The adapters live in `cx_plugins.checkpoint_io`; a stage's tensor streams and sink in `_stage_tensors.py`; what the
ranks check and merge collectively in `_stage_agreement.py`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from cx_checkpoint import (
    CheckpointKind,
    CheckpointReader,
    FileFormat,
    GeneralCheckpointIO,
    KeyMismatchError,
    LoadResult,
    OptimizerMeta,
    check_optimizer_class,
    file_names,
    hf_side_files,
    load_into,
    optimizer_tensor_name,
    read_optimizer_meta,
    require_names,
    write_sharded,
    write_side_files,
)
from cx_plugins._layout import Axis
from cx_plugins.checkpoint_io._expert_shards import ExpertParallelShards
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.checkpoint_io._replicated import ShardedOptimizerCheckpointIO, StateView, split_scaler, with_scaler
from cx_plugins.checkpoint_io._stage_names import StagePlan, module_tensor_names
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards
from cx_plugins.hybrid._stage_agreement import (
    agree_load,
    check_state_shapes,
    class_of,
    merge_descriptions,
    require_same_entries,
    world,
)
from cx_plugins.hybrid._stage_tensors import StageSink, stage_tensors, state_tensors

__all__ = ["HybridCheckpointIO"]


class HybridCheckpointIO(ShardedOptimizerCheckpointIO):
    """Checkpoints of a `ParallelModelView` (TP shards, expert slices over ep, pipeline stages, dp replicas) and its
    by-name optimizer.

    `parts_of(optimizer)` finds the model an optimizer was boosted with (its names, stages and TP specs) and the
    optimizer's by-name face, None for an optimizer this IO does not know;
    `after_model_load(view)` refreshes what depends on the weights (fp32 master copies) after a model load;
    `model_dtype`: the dtype the user's model had before a mixed-precision cast (floating tensors are saved in it and
    cast back on load, as the ZeRO plugins do), or a function giving it for a model; None saves the dtype the module
    holds.
    """

    def __init__(
        self,
        parts_of: Callable[[torch.optim.Optimizer], tuple[ParallelModelView, ParallelOptimizerView] | None],
        after_model_load: Callable[[ParallelModelView], None] | None = None,
        model_dtype: torch.dtype | Callable[[ParallelModelView], torch.dtype | None] | None = None,
    ) -> None:
        super().__init__()
        self._parts_of = parts_of
        self._after_model_load = after_model_load
        self._model_dtype = model_dtype

    def _dtype(self, view: ParallelModelView) -> torch.dtype | None:
        dtype = self._model_dtype
        return dtype if dtype is None or isinstance(dtype, torch.dtype) else dtype(view)

    # ---- helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _view(model: nn.Module) -> ParallelModelView:
        if not isinstance(model, ParallelModelView):
            raise TypeError(
                f"HybridCheckpointIO needs the model booster.boost returned (a ParallelModelView), got "
                f"{type(model).__name__}"
            )
        return model

    @staticmethod
    def _refuse_async(use_async: bool, what: str) -> None:
        if use_async:
            raise NotImplementedError(
                f"HybridCheckpointIO: use_async=True is not supported for {what} yet (the TP / pipeline gathers are "
                "collective and the writer thread cannot take part in them); save with use_async=False"
            )

    def _tp(self, view: ParallelModelView) -> ExpertParallelShards:
        """TP shards and expert slices of the model (the expert part is empty without expert parallelism)."""
        module = view.unwrap()
        return ExpertParallelShards.of_module(
            module, TensorParallelShards.of_module(module, view.layout.group_or_none(Axis.TP))
        )

    @staticmethod
    def _parts_dir(checkpoint: Path) -> Path:
        """Where a single-file save first gathers its sharded parts (a hidden sibling, removed afterwards)."""
        return checkpoint.parent / f".{checkpoint.name}.cx-parts"

    # ---- model --------------------------------------------------------------------------------------------
    def _model_stream(self, view: ParallelModelView) -> Iterator[tuple[str, torch.Tensor]]:
        plan = StagePlan.build(view)  # collective over the pipeline group: before the writer starts
        tp = self._tp(view)
        return stage_tensors(plan, tp, self._dtype(view))

    def _write_model(
        self,
        view: ParallelModelView,
        directory: Path,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
    ) -> None:
        stream = self._model_stream(view)
        side = hf_side_files(view.unwrap())
        write_sharded(
            directory,
            stream,
            kind=CheckpointKind.MODEL,
            file_format=FileFormat.SAFETENSORS if use_safetensors else FileFormat.BIN,
            size_per_shard=size_per_shard,
            prefix=prefix,
            group=world(),
            extra_files=lambda staging: write_side_files(staging, side),
        )

    def save_sharded_model(
        self,
        model: nn.Module,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
        use_async: bool,
    ) -> None:
        view = self._view(model)
        self._refuse_async(use_async, "the model")
        self._write_model(view, checkpoint, prefix, size_per_shard, use_safetensors)

    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None:
        """One file needs every tensor on one rank: the stages first write their parts in parallel (as a sharded
        save), then the master rank reads them into the single file and removes the parts."""
        view = self._view(model)
        self._refuse_async(use_async, "the model")
        parts = self._parts_dir(checkpoint)
        self._write_model(view, parts, None, 1024, True)
        owner = view.unwrap()

        def merge() -> None:
            try:
                with CheckpointReader.open(parts, CheckpointKind.MODEL) as reader:
                    state = {name: reader.read(name).clone() for name in reader.names()}
                # GeneralCheckpointIO's writer itself: this already runs on the master only
                GeneralCheckpointIO.save_unsharded_model(
                    self, StateView(state, owner), checkpoint, gather_dtensor, use_safetensors, False
                )
            finally:
                shutil.rmtree(parts, ignore_errors=True)

        self._on_master(merge, f"saving the model to {checkpoint}")

    def _load_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        if not isinstance(model, ParallelModelView):
            return super()._load_model(model, checkpoint, strict)
        view = self._view(model)
        tp = self._tp(view)
        known = module_tensor_names(view.unwrap())
        results: list[LoadResult] = []

        def load() -> None:
            sink = tp.sink(StageSink(view, self._dtype(view)))
            with CheckpointReader.open(checkpoint, CheckpointKind.MODEL) as reader:
                # names checked against the whole model (other stages' names are expected, not loaded here) before
                # anything is copied, so a refused load leaves the model untouched
                missing = sorted(set(sink.expected_tensors()) - set(reader.specs))
                unexpected = sorted(set(reader.specs) - known)
                if strict and (missing or unexpected):
                    raise KeyMismatchError(
                        f"{checkpoint}: tensor names differ from the model's (strict=True)", missing, unexpected
                    )
                load_into(reader, sink, strict=False)
            results.append(LoadResult(tuple(missing), tuple(unexpected)))

        agree_load(load, f"loading the model from {checkpoint}")
        if self._after_model_load is not None:
            self._after_model_load(view)
        return results[0]

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None:
        """Refused: the master rank alone would write its own TP shards and stage as if they were the model."""
        raise NotImplementedError(
            "HybridCheckpointIO: save_lora_as_pretrained with tensor or pipeline parallelism is not supported yet"
        )

    # ---- optimizer ----------------------------------------------------------------------------------------
    def _pair(self, optimizer: torch.optim.Optimizer) -> tuple[ParallelModelView, ParallelOptimizerView]:
        parts = self._parts_of(optimizer)
        if parts is None:
            raise ValueError(
                "HybridCheckpointIO: this optimizer was not boosted by this plugin (it needs state_dict_by_name and "
                "its model): pass the optimizer booster.boost returned"
            )
        view, face = parts
        return self._view(cast(nn.Module, view)), face

    def _save_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        view, face = self._pair(optimizer)
        self._refuse_async(use_async, "the optimizer")
        kind = class_of(optimizer)
        if shard:
            self._write_optimizer(view, face, checkpoint, prefix, size_per_shard, kind)
            return
        parts = self._parts_dir(checkpoint)
        self._write_optimizer(view, face, parts, None, 1024, kind)

        def merge() -> None:
            try:
                meta, tensors = self.load_optimizer_parts(parts)
                tensors = {name: tensor.clone() for name, tensor in tensors.items()}
                self.save_optimizer_parts(meta, tensors, checkpoint, shard=False)
            finally:
                shutil.rmtree(parts, ignore_errors=True)

        self._on_master(merge, f"saving the optimizer to {checkpoint}")

    def _write_optimizer(
        self,
        view: ParallelModelView,
        face: ParallelOptimizerView,
        directory: Path,
        prefix: str | None,
        size_per_shard: float,
        optimizer_class: str | None,
    ) -> None:
        state_dict = face.state_dict_by_name()  # collective over the data-parallel group
        plan = StagePlan.build(view)
        tp = self._tp(view)
        state: dict[str, dict[str, Any]] = state_dict.get("state", {})
        order = [name for name, _, _ in plan.entries if name in state]
        require_same_entries(view.layout.rank(Axis.PP), state, order, plan.gathers)
        described = {
            name: {
                key: {"tensor": optimizer_tensor_name(name, key)}
                if isinstance(value, torch.Tensor)
                else {"value": value}
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
        write_sharded(
            directory,
            state_tensors(plan, tp, state, order),
            kind=CheckpointKind.OPTIMIZER,
            size_per_shard=size_per_shard,
            prefix=prefix,
            group=world(),
            extra_files=lambda staging: (staging / json_name).write_text(text),
        )

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        view, face = self._pair(optimizer)
        tp = self._tp(view)
        held = view.held_parameter_names()
        shapes = {name: tuple(p.shape) for name, p in view.unwrap().named_parameters() if name in held}
        loaded: list[dict[str, Any]] = []

        def read() -> None:
            with CheckpointReader.open(checkpoint, CheckpointKind.OPTIMIZER, prefix) as reader:
                meta = read_optimizer_meta(reader)
                require_names(meta, str(checkpoint))  # stages and TP shards are matched by name
                if isinstance(optimizer, torch.optim.Optimizer):  # another class's state would fail inside step()
                    check_optimizer_class(meta, optimizer, str(checkpoint))
                meta, scaler = split_scaler(meta)
                state: dict[str, dict[str, Any]] = {}
                for name, entries in meta.state.items():
                    if name not in held:
                        continue
                    state[name] = {
                        key: tp.scatter(entry["tensor"], reader.read(entry["tensor"]))
                        if "tensor" in entry
                        else entry["value"]
                        for key, entry in entries.items()
                    }
                    check_state_shapes(name, state[name], shapes[name], checkpoint)
            groups = [
                {
                    **{k: v for k, v in group.items() if k != "param_names"},
                    "params": [n for n in group["param_names"] if n in held],
                }
                for group in meta.param_groups
            ]
            result: dict[str, Any] = {"state": state, "param_groups": groups}
            if scaler is not None:
                result["grad_scaler"] = scaler
            loaded.append(result)

        agree_load(read, f"reading the optimizer from {checkpoint}")
        face.load_state_dict_by_name(loaded[0])
