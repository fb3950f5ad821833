"""Make the ranks of one model replica start from the same full model before tensor parallelism slices it.

Each tp (sp, pp, ep) rank cuts its slice out of the model it built itself; ranks built with different seeds would
train a model that is none of theirs, and the data-parallel broadcast after slicing cannot repair it (it runs per
slice). So before slicing:

- an eager model: every parameter and buffer is fingerprinted (two int64 per tensor, `_fingerprint.py`) and one
  all-reduce of those few bytes tells which tensors differ; only those are broadcast from the group's first rank.
  Ranks seeded alike (the usual case) pay a local pass over the weights and one tiny all-reduce, nothing more;
- a lazily built model (`LazyInitContext`): the random state each construction tape replays from is broadcast from
  the group's first rank (a few KB), so every rank materialises the same values.

Together with the data-parallel broadcast after slicing, every rank holds global rank 0's model (docs/plugins.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup, all_reduce, assert_same_across_ranks, communication_device
from cx_plugins.hybrid._fingerprint import tensor_fingerprint
from cx_plugins.lazy._context import LazyModel

__all__ = ["agree_initial_states"]


def agree_initial_states(
    model: nn.Module, lazy: LazyModel | None, group: ProcessGroup | None, plugin: str
) -> list[str]:
    """Make every rank of `group` hold `group`'s first rank's `model` (module docs); returns the names of the
    tensors an eager model had to broadcast (the same list on every rank). Collective over `group`."""
    if group is None or dist.get_world_size(group) == 1:
        return []
    tensors = [(n, p) for n, p in model.named_parameters()] + [(n, b) for n, b in model.named_buffers()]
    assert_same_across_ranks(
        [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors],
        group,
        what=f"{plugin}: the model passed to boost (parameter and buffer names, shapes and dtypes)",
    )
    if lazy is not None:
        _agree_lazy_replay(lazy, group)
        return []
    tensors = [(name, t) for name, t in tensors if t.device.type != "meta"]
    if not tensors:
        return []
    device = communication_device(group)
    with torch.no_grad():
        mine = torch.stack([tensor_fingerprint(t).to(device) for _, t in tensors]).reshape(-1)
        extremes = torch.cat([mine, torch.bitwise_not(mine)])  # max of ~x is ~min x: both extremes in one call
        all_reduce(extremes, dist.ReduceOp.MAX, group)
        highest, lowest = extremes[: mine.numel()], torch.bitwise_not(extremes[mine.numel() :])
        differing = (highest != lowest).reshape(len(tensors), 2).any(dim=1).nonzero().reshape(-1).tolist()
        for index in differing:
            _broadcast_in_place(tensors[index][1], group, device)
    return [tensors[i][0] for i in differing]


def _broadcast_in_place(tensor: torch.Tensor, group: ProcessGroup, device: torch.device) -> None:
    if tensor.device == device:
        dist.broadcast(tensor.data, group=group, group_src=0)
        return
    staged = tensor.detach().to(device)
    dist.broadcast(staged, group=group, group_src=0)
    tensor.data.copy_(staged)


def _agree_lazy_replay(lazy: LazyModel, group: ProcessGroup) -> None:
    """Give every construction tape of `lazy` the random state of `group`'s first rank."""
    device = communication_device(group)
    for state in lazy.replay_rng_states():
        staged = state.to(device)
        dist.broadcast(staged, group=group, group_src=0)
        state.copy_(staged)
