"""What the ranks of a hybrid checkpoint save or load agree on, collectively over the world: a load fails on every
rank if it fails on one, the ranks gathering a stage's optimizer state hold the same entries, and the stages'
optimizer descriptions merge into one."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from cx_checkpoint import CheckpointError, OptimizerMeta, optimizer_class_name
from cx_mesh import ProcessGroup, all_gather_bytes

__all__ = ["agree_load", "check_state_shapes", "class_of", "merge_descriptions", "require_same_entries", "world"]


def world() -> ProcessGroup:
    return cast(ProcessGroup, dist.group.WORLD)


def agree_load(step: Callable[[], None], what: str) -> None:
    """Run one rank's part of a load, then raise on every rank if any rank failed (a rank that went on training
    alone would leave the others waiting in a collective)."""
    failure: Exception | None = None
    try:
        step()
    except Exception as error:
        failure = error
    report = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()
    failed = [(r, m.decode(errors="replace")) for r, m in enumerate(all_gather_bytes(report, world())) if m]
    if failure is not None:
        raise failure
    if failed:
        detail = "; ".join(f"rank {r}: {message}" for r, message in failed)
        raise CheckpointError(f"{what} failed on rank(s) {[r for r, _ in failed]}: {detail}")


def class_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The class recorded in the description: the user's torch optimizer the plugin was given (what a load into
    another class checks against, as GeneralCheckpointIO does); None for a by-name face that is not one."""
    return optimizer_class_name(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else None


def require_same_entries(stage: int, state: dict[str, dict[str, Any]], order: list[str], gathers: bool) -> None:
    """The ranks gathering one stage's optimizer state over tp and ep must hold the same entries in the same order
    (each gather pairs them tensor by tensor): checked first (collective over the world), so that a difference is an
    error naming the first differing parameter on every rank, never a gather of mismatched tensors or a hang."""
    entries = [[name, sorted(k for k, v in state[name].items() if isinstance(v, torch.Tensor))] for name in order]
    payload = json.dumps({"stage": stage, "entries": entries}).encode() if gathers else b""
    first: dict[int, list[Any]] = {}
    for rank, raw in enumerate(all_gather_bytes(payload, world())):
        if not raw:
            continue
        theirs = json.loads(raw)
        mine = first.setdefault(theirs["stage"], theirs["entries"])
        if theirs["entries"] != mine:
            differing = _first_difference(mine, theirs["entries"])
            raise CheckpointError(
                f"saving the optimizer: rank {rank} holds other optimizer state entries than its stage's first writer "
                f"(first difference at {differing}); the tp / ep ranks of a stage must step the same parameters"
            )


def _first_difference(mine: list[Any], theirs: list[Any]) -> str:
    """The parameter name where two [name, keys] lists first differ."""
    for a, b in zip(mine, theirs, strict=False):
        if a != b:
            return str(a[0])
    longer = mine if len(mine) > len(theirs) else theirs
    return str(longer[min(len(mine), len(theirs))][0])


def check_state_shapes(name: str, entries: dict[str, Any], shape: tuple[int, ...], checkpoint: Path) -> None:
    """A state tensor shaped like a parameter (same rank) must be shaped like this one's local slice once cut: a
    checkpoint of another model (another expert count, hidden size) is refused by name here rather than deep inside
    the optimizer's step. Factored states of lower rank (Adafactor's) pass."""
    for key, value in entries.items():
        if isinstance(value, torch.Tensor) and value.dim() == len(shape) and tuple(value.shape) != shape:
            raise ValueError(
                f"{checkpoint}: optimizer state {key!r} of {name} does not fit the parameter (after the tp / ep cut "
                f"it is {tuple(value.shape)}, the parameter's slice here is {shape}): a checkpoint of another model?"
            )


def merge_descriptions(mine: OptimizerMeta | None, order: list[str]) -> OptimizerMeta:
    """Every writing stage's description merged into one (collective over the world): the states of all stages,
    and each param group holding the names of every stage (in the model's parameter order)."""
    payload = b"" if mine is None else mine.to_json().encode()
    metas = [OptimizerMeta.from_json(raw.decode(), "a stage's optimizer description") for raw in
             all_gather_bytes(payload, world()) if raw]  # fmt: skip
    if not metas:
        raise CheckpointError("no rank described its optimizer state")
    counts = {len(m.param_groups) for m in metas}
    if len(counts) != 1:
        raise ValueError(f"the pipeline stages' optimizers have different numbers of param groups: {sorted(counts)}")
    position = {name: i for i, name in enumerate(order)}
    groups: list[dict[str, Any]] = []
    for number in range(counts.pop()):
        names = {n for m in metas for n in m.param_groups[number]["param_names"]}
        hyper = {k: v for k, v in metas[0].param_groups[number].items() if k != "param_names"}
        ordered = sorted(names, key=lambda n: (position.get(n, len(position)), n))
        groups.append({**hyper, "param_names": ordered})
    state: dict[str, dict[str, dict[str, Any]]] = {}
    for meta in metas:
        state.update(meta.state)
    return OptimizerMeta(groups, state)
