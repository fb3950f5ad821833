"""Split a model into pipeline stages: the `PipelineSplittable` protocol and `split_model`.

A model (cx's reference GPT, a test model, or `HFDecoderSplitter` around a transformers decoder) says how many layers
it has and builds the module of any layer range, with the input side on the first virtual stage and the head on the
last. `split_model` asks the stage manager for the layer distribution, builds every virtual stage's module (cheap:
they reference the model's own submodules), keeps this rank's chunks, and finds parameters that more than one stage
holds (tied embeddings) by identity, creating a process group over the stages that share each.
"""

from __future__ import annotations

import itertools
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from cx_mesh import assert_same_across_ranks
from cx_pipeline._balance import layer_costs
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._model import PipelineModel, SharedParameter
from cx_pipeline._stage_manager import PipelineStageManager

__all__ = ["PipelineSplittable", "split_model"]


@runtime_checkable
class PipelineSplittable(Protocol):
    """What a model offers to be split into stages.

    `pipeline_stage_module(start, end, first, last)` returns a module running layers [start, end), preceded by the
    input side (embeddings) when `first` and followed by the output side (final norm, head) when `last`. It must
    reference the model's own submodules (not copies), so that tied parameters are found by identity. The module
    follows the stage calling convention (see `docs/pipeline.md`): it receives the micro-batch plus the previous
    stage's dict, and returns a dict unless it is the last stage.
    """

    def pipeline_num_layers(self) -> int: ...

    def pipeline_stage_module(self, start: int, end: int, first: bool, last: bool) -> nn.Module: ...


def split_model(
    model: PipelineSplittable, stage_manager: PipelineStageManager, release_other_stages: bool = False
) -> PipelineModel:
    """This rank's chunks of `model` under `stage_manager`'s layer distribution, with its shared parameters.

    Collective (every rank of the mesh must call it): the groups for shared parameters are created here. With
    `release_other_stages=True` the parameters and buffers that only other ranks' stages hold are replaced by meta
    tensors in the submodules owning them, so their memory is freed at once even while the caller still holds
    `model` (which is then usable only through the returned chunks).
    """
    if not isinstance(model, PipelineSplittable):
        raise PipelineConfigError(
            f"{type(model).__name__} cannot be split into pipeline stages: it must implement pipeline_num_layers() "
            "and pipeline_stage_module(start, end, first, last) (the PipelineSplittable protocol); wrap a "
            "transformers model in HFDecoderSplitter"
        )
    manager = stage_manager
    num_virtual = manager.num_virtual_stages
    costs = layer_costs(model) if manager.balance_layers else None
    layers = manager.distribute_layers(model.pipeline_num_layers(), costs=costs)
    if costs is not None:  # each rank counted its own parameters: the stages must still agree on one split
        assert_same_across_ranks(layers, manager.pp_group, "the layers per stage balanced by each rank's parameters")
    bounds = [0]
    for count in layers:
        bounds.append(bounds[-1] + count)
    modules = [
        model.pipeline_stage_module(bounds[v], bounds[v + 1], v == 0, v == num_virtual - 1) for v in range(num_virtual)
    ]
    holders: dict[int, tuple[str, nn.Parameter, set[int]]] = {}
    for virtual, module in enumerate(modules):
        stage = manager.locate_virtual_stage(virtual)[0]
        for name, param in module.named_parameters():
            entry = holders.setdefault(id(param), (name, param, set()))
            entry[2].add(stage)
    shared = []
    for name, param, stages in holders.values():
        if len(stages) < 2:
            continue
        group = manager.init_process_group_by_stages(sorted(stages))  # collective: same order on every rank
        if manager.stage in stages:
            shared.append(SharedParameter(name, param, tuple(sorted(stages)), group))
    chunks = [modules[manager.virtual_stage(chunk)] for chunk in range(manager.num_model_chunks)]
    if release_other_stages:
        _release(modules, chunks)
    return PipelineModel(chunks, shared)


def _release(modules: list[nn.Module], kept: list[nn.Module]) -> None:
    """Replace every parameter and buffer of `modules` that no module of `kept` holds by a meta tensor (same shape,
    dtype and requires_grad, no storage) in the submodule that owns it, so the full model, whose submodules the
    stages are, sees the replacement too. (A CPU tensor's data cannot be swapped for a meta one in place.)"""
    keep = {id(t) for module in kept for t in itertools.chain(module.parameters(), module.buffers())}
    for module in modules:
        for owner in module.modules():
            for name, param in list(owner._parameters.items()):
                if param is not None and id(param) not in keep and param.device.type != "meta":
                    meta = torch.empty_like(param, device="meta")
                    owner._parameters[name] = nn.Parameter(meta, requires_grad=param.requires_grad)
            for name, buffer in list(owner._buffers.items()):
                if buffer is not None and id(buffer) not in keep and buffer.device.type != "meta":
                    owner._buffers[name] = torch.empty_like(buffer, device="meta")
