"""`HybridParallelModule`: the model HybridParallelPlugin hands back, and the composition that builds it.

`compose_model` runs, in order: ShardFormer (tensor/sequence parallelism, in place: parameter names and objects are
kept), the pipeline split (this rank's stage chunks; `PipelineModel`, each told to take sequence shards under sequence
parallelism), the cast to the training precision of what this rank runs, and the release of the parameters of other
stages (swapped for meta tensors of the same shape under the same names, so `unwrap().named_parameters()` still lists
the whole model and checkpoint IO skips what is not held). The boosted module's own `parameters()` / `buffers()` list
only what this rank holds, as ColossalAI's do (it drops other stages' tensors): a placeholder has no values to compare,
sum or clip. The module implements the face checkpoint IO reads
(`ParallelModelView` in `cx_plugins/checkpoint_io/_parallel_view.py`: `unwrap`, `layout`, `held_parameter_names`,
`held_buffer_names`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from cx_pipeline import (
    GPT2Splitter,
    HFDecoderSplitter,
    PipelineModel,
    PipelineSplittable,
    PipelineStageManager,
    split_model,
)
from cx_plugins._layout import ParallelLayout
from cx_plugins._lora import under_adapters
from cx_plugins.hybrid._batch_check import BatchCheck
from cx_plugins.lazy._context import LazyModel
from cx_plugins.lazy._tp import materialise_sliced
from cx_plugins.wrappers._base import ModelWrapper
from cx_shardformer import Policy, ShardConfig, ShardFormer, shard_sequence_at_stage
from cx_shardformer.policies import NoPolicyError

__all__ = ["ComposedModel", "HybridParallelModule", "compose_model"]


class HybridParallelModule(ModelWrapper):
    """The user's module after ShardFormer (and, with pp > 1, this rank's stage chunks in `pipeline`).

    Under fp16/bf16 (`compute_dtype`), floating-point inputs are cast to it before the module sees them, as
    ColossalAI's HybridParallelModule does: a script passing fp32 `inputs_embeds` (or pixels) to a half-precision
    model would otherwise fail in its first matmul ("expected m1 and m2 to have the same dtype")."""

    def __init__(
        self,
        module: nn.Module,
        layout: ParallelLayout,
        pipeline: PipelineModel | None,
        held: frozenset[str],
        *,
        compute_dtype: torch.dtype = torch.float32,
        batch_check: BatchCheck | None = None,
    ) -> None:
        super().__init__(module)
        self.layout = layout
        self.compute_dtype = compute_dtype
        self.batch_check = batch_check  # None: no check (a replica of one rank; or turned off, as the benchmark does)
        self.__dict__["pipeline"] = pipeline  # not a submodule: its parameters are the module's own
        self._held = held
        persistent = _persistent_buffer_names(module)  # not state_dict(): a collective over tp for sharded layers
        held_buffers = {
            id(b) for chunk in (pipeline.chunks if pipeline is not None else [module]) for b in chunk.buffers()
        }
        self._held_buffers = frozenset(
            name for name, buffer in module.named_buffers() if name in persistent and id(buffer) in held_buffers
        )
        self.__dict__["_settlers"] = []  # not module state: callables, held weakly
        self.__dict__["_released"] = frozenset(  # other stages' placeholders: ids, not module state
            id(t) for t in (*module.parameters(), *module.buffers()) if t.device.type == "meta"
        )
        self.register_state_dict_pre_hook(lambda *_: self.settle_parameters())

    pipeline: PipelineModel | None

    def settle_on_read(self, settle: Callable[[], None]) -> None:
        """Run `settle` (held weakly, a bound method) before the weights are read: `overlap_allgather` leaves the
        step's updated shards in flight until the next forward, and a save, a load, `state_dict()` or `unwrap()` in
        between must see (or replace) the updated weights, not the previous step's."""
        self.__dict__["_settlers"].append(weakref.WeakMethod(settle))

    def settle_parameters(self) -> None:
        """Finish whatever is still writing the weights (the deferred all-gathers of a ZeRO step)."""
        for reference in self.__dict__["_settlers"]:
            settle = reference()
            if settle is not None:
                settle()

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters this rank holds (its pipeline stages'); `unwrap()` still lists the whole model's."""
        released = self.__dict__["_released"]
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            if id(param) not in released:
                yield name, param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The buffers this rank holds, as `named_parameters`."""
        released = self.__dict__["_released"]
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            if id(buffer) not in released:
                yield name, buffer

    def unwrap(self) -> nn.Module:
        self.settle_parameters()  # whoever unwraps reads or writes the weights next
        return super().unwrap()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline is not None:
            raise RuntimeError(
                "this model is split into pipeline stages (pp_size > 1): run it with "
                "booster.execute_pipeline(data_iter, model, criterion, optimizer), not model(...)"
            )
        args, kwargs = self.cast_inputs((args, kwargs))
        if self.batch_check is not None:  # every rank of the replica must be given the same inputs
            self.batch_check({**{f"args[{i}]": value for i, value in enumerate(args)}, **kwargs})
        return self.module(*args, **kwargs)

    def prepare_inputs(self, batch: Any) -> Any:
        """A pipeline step's batch: `cast_inputs`, then checked as `model(...)` checks its inputs (collective over
        the replica group: each `execute_pipeline` step calls it once on every rank)."""
        batch = self.cast_inputs(batch)
        if self.batch_check is not None:
            self.batch_check(batch)
        return batch

    def cast_inputs(self, inputs: Any) -> Any:
        """`inputs` (any nest of containers) with its floating-point tensors cast to `compute_dtype`; integer ids,
        masks of other dtypes and non-tensors unchanged. fp32 training casts nothing."""
        if self.compute_dtype == torch.float32:
            return inputs
        dtype = self.compute_dtype

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
                return value.to(dtype)
            return value

        return tree_map(cast, inputs)

    def held_parameter_names(self) -> frozenset[str]:
        """Names (in `unwrap().named_parameters()`) whose values this rank holds: its pipeline stage(s)' ones."""
        return self._held

    def held_buffer_names(self) -> frozenset[str]:
        """The same for persistent buffers."""
        return self._held_buffers


def _persistent_buffer_names(module: nn.Module) -> set[str]:
    names = set()
    for prefix, sub in module.named_modules():
        skipped: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in skipped:
                names.add(f"{prefix}.{name}" if prefix else name)
    return names


@dataclass
class ComposedModel:
    module: nn.Module
    pipeline: PipelineModel | None
    held: list[nn.Parameter]
    names: dict[int, str]


def compose_model(
    model: nn.Module,
    shard_config: ShardConfig | None,
    policy: Policy | None,
    stage_manager: PipelineStageManager | None,
    dtype: torch.dtype,
    device: torch.device,
    lazy: LazyModel | None = None,
    *,
    plugin: str,
) -> ComposedModel:
    """ShardFormer, pipeline split, cast, release of other stages' parameters (module docs). A model built under
    `LazyInitContext` (`lazy`) is sharded and split while still on the meta device, then materialised one parameter
    at a time, each cut at once to this rank's tensor-parallel slice; other stages' parameters are never made.
    `plugin` (the plugin class's name) starts the errors the user sees."""
    inner = under_adapters(model)
    if shard_config is not None:
        try:
            sharded, _ = ShardFormer(shard_config).optimize(inner, policy=policy)
        except NoPolicyError as error:  # the plugin's user passes custom_policy=, not ShardFormer's policy=
            remedy = f"pass custom_policy=<a cx_shardformer Policy instance> to {plugin}"
            raise NoPolicyError(error.model_class, error.known, remedy) from None
        if inner is model:
            model = sharded
        elif sharded is not inner:
            raise TypeError(f"{plugin}: the policy replaced the model under its LoRA adapters; LoRA needs it in place")
        inner = sharded
    tp_group = shard_config.tensor_parallel_process_group if shard_config is not None else None
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    if stage_manager is None:
        if lazy is not None:
            materialise_sliced(model, lazy, tp_group)
        model.to(device=device, dtype=dtype)
        return ComposedModel(model, None, list({id(p): p for p in model.parameters()}.values()), names)
    pipeline = split_model(_splitter(inner, plugin), stage_manager)
    for chunk in pipeline.chunks:  # with sequence parallelism, stages pass on sequence shards
        shard_sequence_at_stage(inner, chunk)
    held = list({id(p): p for p in pipeline.parameters()}.values())
    held_ids = {id(p) for p in held}
    for param in list({id(p): p for p in model.parameters()}.values()):
        if id(param) not in held_ids:
            _release(param)
    if lazy is not None:
        materialise_sliced(model, lazy, tp_group, held_ids)
    for chunk in pipeline.chunks:
        chunk.to(device=device, dtype=dtype)
    return ComposedModel(model, pipeline, held, names)


def _release(param: nn.Parameter) -> None:
    """Free another stage's parameter, keeping its object, name and shape (a meta tensor takes its place)."""
    attributes = dict(param.__dict__)
    placeholder = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"), param.requires_grad)
    torch.utils.swap_tensors(param, placeholder)
    param.__dict__.update(attributes)  # e.g. the ShardSpec of a tensor-parallel shard


def _splitter(model: nn.Module, plugin: str) -> PipelineSplittable:
    """How to cut `model` into stages: its own protocol, GPT-2's splitter, or the Llama-style decoder splitter."""
    if isinstance(model, PipelineSplittable):
        return model
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gpt2":
        return GPT2Splitter(model)
    if model_type is not None:
        return HFDecoderSplitter(model)  # refuses decoder types it cannot split, naming the supported ones
    raise TypeError(
        f"{plugin}(pp_size > 1) cannot split a {type(model).__name__} into stages: give it "
        "pipeline_num_layers() and pipeline_stage_module(start, end, first, last) (cx_pipeline.PipelineSplittable), "
        "or use a transformers decoder"
    )


def broadcast_states(
    module: nn.Module, held: list[nn.Parameter], group: dist.ProcessGroup | None, buffers: bool
) -> None:
    """Start every data-parallel replica from the first one's parameters (and buffers) as torch DDP does."""
    if group is None or dist.get_world_size(group) == 1:
        return
    with torch.no_grad():
        tensors = [p.data for p in held]
        if buffers:
            tensors += [b for b in module.buffers() if b.device.type != "meta"]
        for tensor in tensors:
            dist.broadcast(tensor, group=group, group_src=0)
