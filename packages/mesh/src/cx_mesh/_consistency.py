"""`assert_same_across_ranks`: fail fast, on every rank, when ranks were given different configurations.

A mismatched configuration (different mesh sizes, precisions, chunk sizes) otherwise surfaces as a hang inside a
collective. Each rank contributes a SHA-256 fingerprint of the value's `repr`; when they differ, the value's fields
(dataclass fields, mapping keys and sequence items, flattened to paths) are gathered too, so that the error, raised
identically on every rank, names the fields that differ, the ranks and what each had (not whole reprs to compare).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

from cx_mesh._collectives import ProcessGroup, all_gather_flat, communication_device, require_initialized

__all__ = ["RankMismatchError", "assert_same_across_ranks", "all_gather_bytes"]

_SHOWN_CHARS = 200
_SHOWN_FIELDS = 10


class RankMismatchError(RuntimeError):
    """Ranks of one process group hold different values for something that must agree."""


def all_gather_bytes(payload: bytes, group: ProcessGroup | None = None) -> list[bytes]:
    """Gather a variable-length byte string from every rank of `group` (tensor collectives only: no pickle)."""
    device = communication_device(group)
    size = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = torch.empty(size, dtype=torch.int64, device=device)
    all_gather_flat(lengths, length, group)
    longest = max(int(lengths.max().item()), 1)
    mine = torch.zeros(longest, dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = torch.empty(size * longest, dtype=torch.uint8, device=device)
    all_gather_flat(gathered, mine, group)
    rows = gathered.view(size, longest).cpu()
    return [bytes(rows[i, : int(lengths[i])].tolist()) for i in range(size)]


def assert_same_across_ranks(value: object, group: ProcessGroup | None = None, what: str = "value") -> None:
    """Raise `RankMismatchError` on every rank of `group` unless all ranks passed an equal `value`.

    Equality is by `repr`, so pass plain data (numbers, strings, tuples, dicts, dataclasses). Collective: every rank
    of the group must call it.
    """
    require_initialized("assert_same_across_ranks")
    text = repr(value)
    digest = hashlib.sha256(text.encode()).digest()
    digests = all_gather_bytes(digest, group)
    if len(set(digests)) == 1:
        return
    leaves = [json.loads(b) for b in all_gather_bytes(json.dumps(_leaves(value)).encode(), group)]
    group_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(digests)))
    by_value: dict[bytes, list[int]] = {}
    for global_rank, fingerprint in zip(group_ranks, digests, strict=True):
        by_value.setdefault(fingerprint, []).append(global_rank)
    majority = max(by_value.values(), key=len)
    differing = sorted(r for ranks in by_value.values() if ranks is not majority for r in ranks)
    lines = _differing_fields(leaves, group_ranks)
    raise RankMismatchError(
        f"ranks disagree on {what}: ranks {differing} differ from ranks {majority}.\n" + "\n".join(lines)
    )


def _leaves(value: object, path: str = "") -> dict[str, str]:
    """`value` flattened to {path: short repr}: dataclass fields, mapping keys and sequence items are followed."""
    children: list[tuple[str, object]] | None = None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        children = [(f".{f.name}" if path else f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif isinstance(value, Mapping):
        children = [(f"[{k!r}]" if path else str(k), v) for k, v in value.items()]
    elif isinstance(value, list | tuple) and value:
        children = [(f"[{i}]", v) for i, v in enumerate(value)]
    if not children:
        return {path or "value": repr(value)[:_SHOWN_CHARS]}
    flat: dict[str, str] = {}
    for suffix, child in children:
        flat.update(_leaves(child, path + suffix))
    return flat


def _differing_fields(leaves: list[dict[str, str]], ranks: list[int]) -> list[str]:
    """One line per field whose value is not the same on every rank: the field, then each value with its ranks."""
    paths = list(dict.fromkeys(p for mine in leaves for p in mine))
    lines = []
    for path in paths:
        holders: dict[str, list[int]] = {}
        for rank, mine in zip(ranks, leaves, strict=True):
            holders.setdefault(mine.get(path, "<absent>"), []).append(rank)
        if len(holders) > 1:
            lines.append(f"  {path}: " + "; ".join(f"ranks {r}: {v}" for v, r in holders.items()))
    if len(lines) > _SHOWN_FIELDS:
        lines = [*lines[:_SHOWN_FIELDS], f"  ... and {len(lines) - _SHOWN_FIELDS} more field(s)"]
    return lines or ["  (the values' reprs differ beyond their first 200 characters per field)"]
