"""LoRA adapters of a tensor- and pipeline-parallel model gathered back into full peft tensors.

Each pipeline stage gathers its adapters' tensor-parallel slices (`unshard_tensor`, a collective over tp: every rank
of a stage walks the same names in the same order); the stages then exchange their full adapters over the pipeline
group, so every rank ends with the whole set under peft's parameter names (they are small: rank-r matrices). The
master rank writes them with peft's own `save_pretrained`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cx_plugins._layout import Axis
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView
from cx_shardformer import get_shard_spec, unshard_tensor

__all__ = ["gathered_adapters"]


def gathered_adapters(view: ParallelModelView, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Every adapter tensor of the model in full, on the CPU, in `dtype` (None: as held), on every rank."""
    module = view.unwrap()
    held = view.held_parameter_names()
    tp_group = view.layout.group_or_none(Axis.TP)
    mine: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if "lora_" not in name or name not in held:
            continue
        spec = get_shard_spec(param)
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        mine[name] = full.to(device="cpu", dtype=dtype or full.dtype).clone()
    pp_group = view.layout.group_or_none(Axis.PP)
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return mine
    stages: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(stages, mine, group=pp_group)
    return {name: tensor for stage in stages if stage is not None for name, tensor in stage.items()}
