"""`BatchCheck`: the ranks of one model replica (tp, sp and pp ranks) must be given the same batch.

Tensor and sequence parallelism slice one batch inside the model, and pipeline stages take the inputs (first stage)
and labels (last stage) from their own copies; ranks fed different batches compute a loss of no batch at all, with
no error. Every call fingerprints the inputs' structure (names, shapes, dtypes: a CPU hash) and all-gathers one
small int64 vector over the replica group, so every rank takes part in the same collective every time whatever it
decides. On the first `first_calls` calls, and whenever this rank's input structure changes, the vector also
carries two int64 fingerprints per input tensor (folded into `SLOTS` slots) and the rank reads it back (a host sync):
a difference raises `RankMismatchError` naming the group, its ranks and the inputs that differ. Other calls read
nothing back, so on a GPU the check never waits for the device. Its cost is in benchmarks/hybrid/RESULTS.md.

Ranks that see the same structure sequence decide alike; a rank whose structure differs from the others' at a call
where they do not look still finds the difference itself, since the structure is in every call's vector.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import GetAttrKey, KeyEntry, MappingKey, SequenceKey, tree_flatten_with_path

from cx_mesh import ProcessGroup, RankMismatchError, all_gather_flat, communication_device
from cx_plugins.hybrid._fingerprint import tensor_fingerprint, text_fingerprint

__all__ = ["BatchCheck"]

SLOTS = 8  # input tensors fold into this many fingerprint slots (exact names up to 8 tensors, the usual case)
_PLAIN = (bool, int, float, str, type(None))


class BatchCheck:
    """Compare the batches the ranks of `group` (global `ranks`, the axes named `axes`) are given (module docs)."""

    def __init__(self, group: ProcessGroup, ranks: list[int], axes: str, plugin: str, first_calls: int = 3) -> None:
        self.group, self.ranks, self.axes, self.plugin = group, ranks, axes, plugin
        self.first_calls = first_calls
        self.calls = 0
        self._structure: int | None = None

    def __call__(self, inputs: Any) -> None:
        """Collective over the group: every rank must call it once per model call (or pipeline step)."""
        leaves = [(_name(path), leaf) for path, leaf in tree_flatten_with_path(inputs)[0]]
        described = [f"{path}: {_describe(leaf)}" for path, leaf in leaves]
        structure = text_fingerprint("\n".join(described))
        look = self.calls < self.first_calls or structure != self._structure
        self.calls += 1
        self._structure = structure
        device = communication_device(self.group)
        mine = torch.zeros(1 + 2 * SLOTS, dtype=torch.int64, device=device)
        mine[0] = structure
        tensors = [(path, leaf) for path, leaf in leaves if isinstance(leaf, torch.Tensor)]
        if look:
            for index, (_, tensor) in enumerate(tensors):
                slot = 1 + 2 * (index % SLOTS)
                mine[slot : slot + 2] += tensor_fingerprint(tensor).to(device)
        everyone = torch.empty(len(self.ranks) * mine.numel(), dtype=torch.int64, device=device)
        all_gather_flat(everyone, mine, self.group)
        if look:
            self._compare(everyone.view(len(self.ranks), -1).cpu(), [p for p, _ in tensors], described)

    def _compare(self, rows: torch.Tensor, tensor_paths: list[str], described: list[str]) -> None:
        by_row: dict[tuple[int, ...], list[int]] = {}
        for rank, row in zip(self.ranks, rows.tolist(), strict=True):
            by_row.setdefault(tuple(row), []).append(rank)
        if len(by_row) == 1:
            return
        majority = max(by_row.values(), key=len)
        reference = next(row for row, ranks in by_row.items() if ranks is majority)
        others = sorted(r for ranks in by_row.values() if ranks is not majority for r in ranks)
        if any(row[0] != reference[0] for row in by_row):
            what = (
                "the inputs' names, shapes or dtypes differ (this rank, global rank "
                f"{dist.get_rank()}, has {'; '.join(described) or 'no inputs'})"
            )
        else:
            slots = {
                s
                for row in by_row
                for s in range(SLOTS)
                if row[1 + 2 * s : 3 + 2 * s] != reference[1 + 2 * s : 3 + 2 * s]
            }
            names = [path for index, path in enumerate(tensor_paths) if index % SLOTS in slots]
            what = f"the values of {', '.join(names)} differ"
        raise RankMismatchError(
            f"{self.plugin}: the ranks of one model replica must be given the same batch, but over the {self.axes} "
            f"group (global ranks {self.ranks}) ranks {others} were given a different one than ranks {majority}: "
            f"{what}. Shard data over the data-parallel ranks only (plugin.prepare_dataloader, or a "
            "DistributedSampler with num_replicas=plugin.dp_size and the data-parallel rank), and give every "
            f"{self.axes} rank of a replica the same batch"
        )


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{tuple(leaf.shape)} {leaf.dtype}"
    if isinstance(leaf, _PLAIN):
        return repr(leaf)
    return type(leaf).__name__


def _name(path: tuple[KeyEntry, ...]) -> str:
    """A leaf's path as a user reads it: `input_ids`, `pixel_values.0`, `args[0]`."""
    parts = []
    for key in path:
        if isinstance(key, MappingKey):
            parts.append(str(key.key))
        elif isinstance(key, SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, GetAttrKey):
            parts.append(key.name)
        else:
            parts.append(str(key))
    return ".".join(parts) or "the input"
