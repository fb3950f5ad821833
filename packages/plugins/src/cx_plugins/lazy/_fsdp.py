"""Lazily built models under FSDP2: `fully_shard` runs on the still-meta model (it only records shapes and placements),
each rank allocates its local shards with `to_empty`, and the construction replay hands every full parameter over
one at a time, cut at once to this rank's shard. No rank ever holds the whole model.

Each rank cuts its own replay, as `fully_shard` cuts each rank's own eager model; with `sync_module_states=True`
every full value is first broadcast from the group's first rank, as the eager path broadcasts the whole model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from cx_plugins.lazy._context import LazyModel

__all__ = ["materialise_into_fsdp_shards"]


def materialise_into_fsdp_shards(
    module: nn.Module,
    lazy: LazyModel,
    names: dict[nn.Parameter, str],
    device: torch.device,
    sync_group: dist.ProcessGroup | bool | None,
) -> None:
    """Fill the local shards of `module` (sharded by `fully_shard` while on the meta device) from `lazy`'s replay.

    `names`: each original (meta) parameter's name, taken before sharding replaced the parameters. `sync_group`:
    False, or the group whose first rank's values every rank takes (None: the world)."""
    module.to_empty(device=device)
    sharded = dict(module.named_parameters())

    def receive(original: nn.Parameter, value: torch.Tensor) -> None:
        target = sharded[names[original]]
        full = value.to(device)
        if sync_group is not False:
            group = sync_group if isinstance(sync_group, dist.ProcessGroup) else None
            source = dist.get_global_rank(group, 0) if group is not None else 0
            dist.broadcast(full, source, group=group)
        with torch.no_grad():
            if isinstance(target, DTensor):
                # src_data_rank=None: every rank cuts its own copy, no communication
                local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(local.to_local())
            else:  # an ignored parameter stays whole
                target.copy_(full)

    lazy.stream(receive)
    for owner in module.modules():  # buffers were put in place on the replay's device
        for name, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.device != device:
                owner._buffers[name] = buffer.to(device)
    left = [name for name, p in module.named_parameters() if p.is_meta]
    left += [name for name, b in module.named_buffers() if b.is_meta]
    if left:
        raise ValueError(f"LazyInitContext: {left[:5]} are still on the meta device after materialising into FSDP")
