"""Optimizer state between its sharded form (each rank's slice of every state tensor) and the full form (whole
tensors shaped like the parameter), so a checkpoint saved at one world size loads at another.

A state entry is sharded when it is a 1-D tensor of the shard's length (Adam's moments, ...); 0-d entries such as
`step` and non-tensor entries are copied as they are. With mixed precision, or fp8 communication (whose E4M3
all-gather rounds the working weights even at fp32), the fp32 master weight travels in the same per-parameter entry
under `MASTER_KEY`, so a run resumes exactly rather than from its rounded working weights; a checkpoint without
masters (older ones) still loads, from the working weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from cx_mesh import ProcessGroup
from cx_zero._comm import gather_to_cpu
from cx_zero._partition import ParamShard, shard_of

__all__ = [
    "MASTER_KEY",
    "EntryLoader",
    "check_group_names",
    "full_state",
    "state_key",
    "positional_optimizer_state",
    "sharded_optimizer_state",
    "size_limited_pieces",
    "sharded_state",
    "state_bytes",
    "stream_full_states",
]

MASTER_KEY = "master_weight"
_SCALAR_KEYS = frozenset({"step"})


def _is_shard_entry(shard: ParamShard, key: str, value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and key not in _SCALAR_KEYS
        and value.dim() == 1
        and value.numel() == shard.shard_numel
    )


def full_state(shard: ParamShard, state: dict[str, Any], group: ProcessGroup | None) -> dict[str, Any]:
    """Gather one parameter's state over its group (collective) into whole tensors on the CPU."""
    result: dict[str, Any] = {}
    for key in sorted(state):
        value = state[key]
        if _is_shard_entry(shard, key, value):
            gathered = gather_to_cpu(value, group, shard.group_size)
            whole = gathered[: shard.numel].view(shard.working.shape)
            result[key] = whole.clone() if shard.padding else whole  # no padded storage behind a saved tensor
        elif isinstance(value, torch.Tensor):
            result[key] = value.detach().cpu().clone()
        else:
            result[key] = value
    return result


def sharded_state(shard: ParamShard, state: dict[str, Any], what: str) -> dict[str, Any]:
    """This rank's slice of one parameter's full state (no communication)."""
    result: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and key not in _SCALAR_KEYS and value.dim() > 0:
            if tuple(value.shape) != tuple(shard.working.shape):
                raise ValueError(
                    f"{what}: state {key!r} has shape {tuple(value.shape)} but the parameter has shape "
                    f"{tuple(shard.working.shape)}; a full (unsharded) optimizer state is expected"
                )
            result[key] = shard_of(value.detach(), shard.group_size, shard.group_rank).clone()
        else:
            result[key] = value
    return result


def state_bytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def size_limited_pieces(
    entries: Iterable[tuple[str, dict[str, Any]]], limit_bytes: int
) -> Iterator[tuple[dict[str, dict[str, Any]], int]]:
    """`entries` (key, state) grouped into pieces of at most `limit_bytes` (a single larger state is a piece of its
    own), each with its byte count; every entry is drawn, so collectives inside the iterable all run."""
    piece: dict[str, dict[str, Any]] = {}
    size = 0
    for key, full in entries:
        nbytes = state_bytes(full)
        if piece and size + nbytes > limit_bytes:
            yield piece, size
            piece, size = {}, 0
        piece[key] = full
        size += nbytes
    if piece:
        yield piece, size


def stream_full_states(
    shards: Sequence[ParamShard],
    optimizer: torch.optim.Optimizer,
    groups: Sequence[ProcessGroup | None],
    prefix: str,
    limit_bytes: int,
    keep: bool,
    include_master: bool,
) -> Iterator[tuple[dict[str, dict[str, Any]], int]]:
    """Gather each shard's state (collective, in `shards` order) and yield pieces of at most `limit_bytes` (a single
    larger parameter is a piece of its own); yields nothing when not `keep`, but still takes part in the gathers.
    With `include_master`, each entry also holds the full master weight under `MASTER_KEY`."""

    def entries() -> Iterator[tuple[str, dict[str, Any]]]:
        for shard in shards:
            state = dict(optimizer.state.get(shard.master, {}))
            if include_master:
                state[MASTER_KEY] = shard.master
            if not state:
                continue
            full = full_state(shard, state, groups[shard.group_index])
            if keep:
                yield prefix + shard.key, full

    return size_limited_pieces(entries(), limit_bytes)


#: What a load keeps of one parameter's saved (full) state entry: the entry the wrapped optimizer loads (None: this
#: rank holds no state for it) and the full master weight found in it (None: none saved).
EntryLoader = Callable[[ParamShard, dict[str, Any]], tuple[dict[str, Any] | None, torch.Tensor | None]]


def positional_optimizer_state(
    state_dict: Mapping[str, Any], shard_groups: Sequence[Sequence[ParamShard]], load_entry: EntryLoader
) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """A full-by-name state dict turned into the wrapped optimizer's own positional one, each parameter's entry
    through `load_entry`, and the masters it found (by id of the shard). The param groups must name the same
    parameters as the optimizer's."""
    saved_groups = list(state_dict["param_groups"])
    if len(saved_groups) != len(shard_groups):
        raise ValueError(f"state dict has {len(saved_groups)} param groups, the optimizer {len(shard_groups)}")
    inner_groups: list[dict[str, Any]] = []
    inner_state: dict[int, dict[str, Any]] = {}
    masters: dict[int, torch.Tensor] = {}
    index = 0
    for saved, shards in zip(saved_groups, shard_groups, strict=True):
        check_group_names(saved, shards)
        ids = []
        for shard in shards:
            entry_key = state_key(state_dict["state"], shard)
            if entry_key is not None:
                entry, master = load_entry(shard, dict(state_dict["state"][entry_key]))
                if master is not None:
                    masters[id(shard)] = master
                if entry:
                    inner_state[index] = entry
            ids.append(index)
            index += 1
        inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    return {"state": inner_state, "param_groups": inner_groups}, masters


def sharded_optimizer_state(
    state_dict: Mapping[str, Any], shard_groups: Sequence[Sequence[ParamShard]]
) -> tuple[dict[str, Any], dict[int, torch.Tensor]]:
    """The wrapped optimizer's own (positional) state dict holding this rank's slices of a full state dict, and the
    master-weight slices found in it (by id of the shard)."""

    def load_entry(shard: ParamShard, entry: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor | None]:
        sliced = sharded_state(shard, entry, shard.key)
        return sliced, sliced.pop(MASTER_KEY, None)

    return positional_optimizer_state(state_dict, shard_groups, load_entry)


def check_group_names(saved: Mapping[str, Any], shards: Sequence[ParamShard]) -> None:
    """ValueError unless a saved param group names the same parameters as this optimizer's group."""
    mine = [s.key for s in shards]
    theirs = [str(key) for key in saved["params"]]
    if sorted(theirs) != sorted(mine):
        missing = sorted(set(mine) - set(theirs))
        extra = sorted(set(theirs) - set(mine))
        raise ValueError(f"param group names differ: missing {missing[:5]}, unexpected {extra[:5]}")


def state_key(states: Mapping[Any, Any], shard: ParamShard) -> str | int | None:
    """The key of `shard`'s entry in a saved state (positional keys may be ints, as in a plain torch optimizer's
    state dict), or None when it has none."""
    if shard.key in states:
        return shard.key
    if shard.key.isdigit() and int(shard.key) in states:
        return int(shard.key)
    return None
