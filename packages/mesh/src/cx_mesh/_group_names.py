"""How cx names a process group: for people (`describe_group`: its description and global ranks) and as a key every
rank of the group agrees on (`group_key`: torch's group name, which `new_group` assigns in creation order, the same
on every rank), under which the collective log counts and the store publishes each rank's position."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["describe_group", "group_key", "group_ranks"]


def describe_group(group: dist.ProcessGroup | None) -> str:
    """A short human name for a group: its description (cx names its groups by mesh axis) and its global ranks."""
    if group is None or group is dist.group.WORLD:
        return "the default group (all ranks)"
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        ranks = []
    description = getattr(group, "group_desc", "") or getattr(group, "group_name", "")
    return f"group {description!r} (ranks {ranks})" if description else f"group of ranks {ranks}"


def group_key(group: dist.ProcessGroup | None) -> str:
    """The group's name, the same on all its ranks; `None` (the default group) is the default group's name."""
    named = group if group is not None else dist.group.WORLD
    return named.group_name if named is not None else "default"


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of `group` (every rank for `None`); none for a group torch no longer knows (destroyed)."""
    try:
        return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):
        return []
