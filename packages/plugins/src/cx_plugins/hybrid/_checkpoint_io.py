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
`use_async=True`: the gathers run before the save returns, into CPU copies, and the same write job then runs on the
writer thread (`_save_jobs.py`: preparation and job; `_writer_group.py`: the group its status exchanges use), behind
the earlier ones. A synchronous save or a load first waits for them; every save and load raises an asynchronous
save's failure on every rank.
The adapters live in `cx_plugins.checkpoint_io`; a stage's tensor streams and sink in `_stage_tensors.py`; what the
ranks check and merge collectively in `_stage_agreement.py`.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from cx_checkpoint import (
    CheckpointKind,
    CheckpointReader,
    KeyMismatchError,
    LoadResult,
    Stateful,
    check_optimizer_class,
    load_into,
    read_optimizer_meta,
    require_names,
    run_and_agree,
)
from cx_mesh import ProcessGroup
from cx_plugins._layout import Axis
from cx_plugins._lora import require_lora, save_lora
from cx_plugins.checkpoint_io._expert_shards import ExpertParallelShards
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.checkpoint_io._replicated import ShardedOptimizerCheckpointIO, split_scaler
from cx_plugins.checkpoint_io._stage_names import module_tensor_names
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards
from cx_plugins.hybrid._lora_save import gathered_adapters
from cx_plugins.hybrid._save_jobs import WriteJob, merge_model, merge_optimizer, model_save, optimizer_save
from cx_plugins.hybrid._stage_agreement import agree_load, check_state_shapes, class_of, world
from cx_plugins.hybrid._stage_tensors import StageSink
from cx_plugins.hybrid._writer_group import WriterGroup

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
        self._writer_group = WriterGroup()

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

    # ---- saves: prepared on the training thread, written now or by the writer thread ---------------------------
    def _save(
        self,
        write: WriteJob,
        checkpoint: Path,
        shard: bool,
        merge: Callable[[Path, Path], None],
        what: str,
        use_async: bool,
    ) -> None:
        """Run a prepared save: sharded straight into `checkpoint`; one file by writing the parts into a hidden
        sibling first (the stages in parallel), then the master rank merging them into the file and removing them.
        With `use_async`, on the writer thread (every rank queues it; see `_writer_group.py`)."""
        master = self._coordinator.is_master()

        def job(group: ProcessGroup) -> None:
            if shard:
                write(checkpoint, group)
                return
            parts = self._parts_dir(checkpoint)
            write(parts, group)

            def merge_parts() -> None:
                try:
                    merge(parts, checkpoint)
                finally:
                    shutil.rmtree(parts, ignore_errors=True)

            run_and_agree(merge_parts if master else None, what, group)

        if not use_async:
            job(world())
            return
        group = self._writer_group.get()
        self._async.submit(lambda: job(group))

    # ---- model --------------------------------------------------------------------------------------------
    def _save_model(
        self,
        model: nn.Module,
        checkpoint: Path,
        shard: bool,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
        use_async: bool,
    ) -> None:
        view = self._view(model)
        # a synchronous save waits for the asynchronous ones (an asynchronous one queues behind them); a failure
        # among them is raised here, on every rank
        self._settle_async(wait=not use_async)
        if shard:
            write = model_save(
                view, self._tp(view), self._dtype(view), prefix, size_per_shard, use_safetensors, use_async
            )
        else:  # the parts of a single file: safetensors, in shards of the default size
            write = model_save(view, self._tp(view), self._dtype(view), None, 1024, True, use_async)
        merge = merge_model(view.unwrap(), gather_dtensor, use_safetensors)
        self._save(write, checkpoint, shard, merge, f"saving the model to {checkpoint}", use_async)

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
        self._save_model(model, checkpoint, True, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async)

    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None:
        self._save_model(model, checkpoint, False, gather_dtensor, None, 1024, use_safetensors, use_async)

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
        """The adapters' tensor-parallel slices and pipeline stages gathered (`_lora_save.py`), then written by the
        master rank in peft's folder format, in the model's own dtype; every rank raises the same error on failure."""
        view = self._view(model)
        require_lora(view.unwrap())  # the same plain error on every rank, before any collective
        self._settle_async()
        adapters = gathered_adapters(view, self._dtype(view))
        self._on_master(
            lambda: save_lora(view.unwrap(), checkpoint, use_safetensors, adapters),
            f"saving LoRA adapters to {checkpoint}",
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
        self._settle_async(wait=not use_async)
        kind = class_of(optimizer)
        if not shard:  # the parts of a single file, in shards of the default size
            prefix, size_per_shard = None, 1024
        write = optimizer_save(view, face, self._tp(view), kind, prefix, size_per_shard, use_async)
        self._save(write, checkpoint, shard, merge_optimizer, f"saving the optimizer to {checkpoint}", use_async)

    def save_lr_scheduler(self, lr_scheduler: Stateful, checkpoint: str | os.PathLike[str]) -> None:
        """As every synchronous save: the asynchronous ones end first, a failure among them raised on every rank."""
        self._settle_async()
        super().save_lr_scheduler(lr_scheduler, checkpoint)

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
