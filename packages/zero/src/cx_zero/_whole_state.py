"""State dicts of a whole-tensor optimizer under ZeRO (`_whole_step`): the same full-by-name form as the elementwise
case (`_state_dict`), so a checkpoint loads at any world size and names its tensors the same way.

Saving: each parameter's state (Muon's momentum, whole) lives on its owner rank, which broadcasts it over the
parameter's group: first a JSON header naming each entry, its dtype and shape (or its plain value), then the
tensors. No pickle anywhere. Loading: every rank reads the full state; the owner keeps the whole tensors, the other
ranks nothing; the fp32 master (mixed precision) goes whole to the owner's whole master and sliced to every rank's
master shard.

The parameters of an optimizer's elementwise groups (`elementwise_groups`: MuonWithAdamW's AdamW groups) are stepped
on their shards, not by `WholeTensorStep`: their states are gathered and sliced as for any elementwise optimizer
(`_state_dict`), in the same per-parameter order, so the saved form is the same full-by-name one either way and a
checkpoint saved when those groups were stepped whole loads here (and the other way round).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroup, communication_device
from cx_zero._partition import ParamShard
from cx_zero._state_dict import (
    MASTER_KEY,
    full_state,
    positional_optimizer_state,
    sharded_state,
    size_limited_pieces,
)
from cx_zero._whole_step import WholeTensorStep

__all__ = ["broadcast_state", "stream_whole_states", "whole_optimizer_state"]


def _broadcast_text(text: str, group: ProcessGroup | None, owner: int) -> str:
    device = communication_device(group)
    data = torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text else torch.empty(0, dtype=torch.uint8)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    dist.broadcast(length, group=group, group_src=owner)
    buffer = (
        data.to(device) if data.numel() == int(length) else torch.empty(int(length), dtype=torch.uint8, device=device)
    )
    dist.broadcast(buffer, group=group, group_src=owner)
    return bytes(buffer.cpu().tolist()).decode()


def _header(state: Mapping[str, Any]) -> str:
    entries: list[list[Any]] = []
    for key in sorted(state):
        value = state[key]
        if isinstance(value, torch.Tensor):
            entries.append([key, "tensor", str(value.dtype).removeprefix("torch."), list(value.shape)])
        else:
            entries.append([key, "value", value])  # json refuses what it cannot write: a clear error on the owner
    return json.dumps(entries)


def whole_full_state(
    shard: ParamShard,
    optimizer: torch.optim.Optimizer,
    whole: WholeTensorStep,
    group: ProcessGroup | None,
    *,
    include_master: bool,
) -> dict[str, Any]:
    """One parameter's full state on every rank of its group, as CPU tensors (collective unless one replica)."""
    tensor = whole.whole[id(shard)]
    owner = whole.owner[id(shard)]
    mine = shard.group_size == 1 or owner == shard.group_rank
    state: dict[str, Any] = dict(optimizer.state.get(tensor, {})) if mine else {}
    if mine and include_master:
        state[MASTER_KEY] = tensor
    if shard.group_size == 1:
        return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in sorted(state.items())}
    return broadcast_state(state if mine else None, group, owner)


def broadcast_state(state: Mapping[str, Any] | None, group: ProcessGroup | None, owner: int) -> dict[str, Any]:
    """The `owner`'s (group rank) `state` on every rank of `group`, tensors as fresh CPU copies: a JSON header
    naming each entry (tensor dtype and shape, or a plain value), then one broadcast per tensor. Collective; `state`
    is read on the owner only (None elsewhere)."""
    header = _broadcast_text(_header(state) if state is not None else "", group, owner)
    device = communication_device(group)
    result: dict[str, Any] = {}
    for key, kind, *rest in json.loads(header):
        if kind == "value":
            result[key] = rest[0]
            continue
        dtype, shape = getattr(torch, rest[0]), rest[1]
        if state is not None:
            buffer = state[key].detach().to(device).contiguous()
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)  # the receiving buffer
        dist.broadcast(buffer, group=group, group_src=owner)
        result[key] = buffer.detach().to("cpu", copy=True)
    return result


def stream_whole_states(
    shards: Sequence[ParamShard],
    optimizer: torch.optim.Optimizer,
    whole: WholeTensorStep,
    groups: Sequence[ProcessGroup | None],
    prefix: str,
    limit_bytes: int,
    keep: bool,
    include_master: bool,
) -> Iterator[tuple[dict[str, dict[str, Any]], int]]:
    """`stream_full_states` for whole-tensor optimizers: pieces of at most `limit_bytes` (collective, in order)."""

    def entries() -> Iterator[tuple[str, dict[str, Any]]]:
        for shard in shards:
            group = groups[shard.group_index]
            if whole.holds(shard):
                full = whole_full_state(shard, optimizer, whole, group, include_master=include_master)
            else:  # an elementwise group's parameter: its state is sliced like its master (`_state_dict`)
                state = dict(optimizer.state.get(shard.master, {}))
                if include_master:
                    state[MASTER_KEY] = shard.master
                full = full_state(shard, state, group) if state else {}
            if keep and full:
                yield prefix + shard.key, full

    return size_limited_pieces(entries(), limit_bytes)


def whole_optimizer_state(
    state_dict: Mapping[str, Any], shard_groups: Sequence[Sequence[ParamShard]], whole: WholeTensorStep
) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """The wrapped optimizer's own (positional) state dict holding the whole states this rank owns and its slices of
    the elementwise groups' states, and every full master weight found (by id of the shard)."""

    def load_entry(shard: ParamShard, entry: dict[str, Any]) -> tuple[dict[str, Any] | None, torch.Tensor | None]:
        if not whole.holds(shard):  # this rank's slices, as for an elementwise optimizer (shapes checked there)
            sliced = sharded_state(shard, entry, shard.key)
            sliced.pop(MASTER_KEY, None)
            return sliced, entry.get(MASTER_KEY)
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shard.working.shape:
                raise ValueError(
                    f"{shard.key}: state {name!r} has shape {tuple(value.shape)} but the parameter has shape "
                    f"{tuple(shard.working.shape)}; a full (unsharded) optimizer state is expected"
                )
        master = entry.pop(MASTER_KEY, None)
        if not entry or not (shard.group_size == 1 or whole.owns(shard)):
            return None, master
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}, master

    return positional_optimizer_state(state_dict, shard_groups, load_entry)
