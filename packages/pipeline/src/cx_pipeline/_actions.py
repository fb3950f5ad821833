"""The schedules as data: for every stage, the ordered list of compute actions it runs in one step.

A schedule is a function (num_stages, num_microbatches, ...) -> per-stage lists of `Action`s over *virtual stages*.
Every rank computes every stage's list (they are deterministic), which is how a receiver knows the order in which a
neighbour sends its messages; each rank runs its own list exactly as listed, so the ranks of one tp or dp group run
their collectives in the same order. `_simulation.simulate` executes the lists to prove a schedule free of deadlock
and to measure its bubble; the zero-bubble V orders live in `_zbv_order`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Action", "ActionKind", "forward_only_order", "interleaved_order", "one_f_one_b_order"]


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: input and weight gradients
    BACKWARD_INPUT = "I"  # input gradients only (zero-bubble)
    BACKWARD_WEIGHT = "W"  # the deferred weight gradients of an earlier BACKWARD_INPUT


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    virtual_stage: int
    microbatch: int

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.virtual_stage}.{self.microbatch}"


Host = Callable[[int], int]  # virtual stage -> pipeline stage


def one_f_one_b_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Warm up with `p - s - 1` forwards, then alternate one forward and one backward, then drain the backwards."""
    orders = []
    for stage in range(num_stages):
        warmup = min(num_stages - stage - 1, num_microbatches)
        actions = [Action(ActionKind.FORWARD, stage, mb) for mb in range(warmup)]
        backward = 0
        for mb in range(warmup, num_microbatches):
            actions.append(Action(ActionKind.FORWARD, stage, mb))
            actions.append(Action(ActionKind.BACKWARD, stage, backward))
            backward += 1
        actions += [Action(ActionKind.BACKWARD, stage, mb) for mb in range(backward, num_microbatches)]
        orders.append(actions)
    return orders


def interleaved_order(num_stages: int, num_chunks: int, num_microbatches: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: groups of `num_stages` micro-batches cycle through the chunks; needs
    `num_microbatches % num_stages == 0`. Chunk `c` of stage `s` is virtual stage `c * num_stages + s`."""
    p, v, m = num_stages, num_chunks, num_microbatches
    total = m * v

    def forward_of(k: int) -> tuple[int, int]:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return chunk, mb

    def backward_of(k: int) -> tuple[int, int]:
        chunk, mb = forward_of(k)
        return v - 1 - chunk, mb

    orders = []
    for stage in range(p):
        warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
        actions: list[Action] = []
        for k in range(warmup):
            chunk, mb = forward_of(k)
            actions.append(Action(ActionKind.FORWARD, chunk * p + stage, mb))
        for k in range(total - warmup):
            chunk, mb = forward_of(k + warmup)
            actions.append(Action(ActionKind.FORWARD, chunk * p + stage, mb))
            chunk, mb = backward_of(k)
            actions.append(Action(ActionKind.BACKWARD, chunk * p + stage, mb))
        for k in range(total - warmup, total):
            chunk, mb = backward_of(k)
            actions.append(Action(ActionKind.BACKWARD, chunk * p + stage, mb))
        orders.append(actions)
    return orders


def forward_only_order(num_stages: int, num_chunks: int, num_microbatches: int, host: Host) -> list[list[Action]]:
    """Evaluation: each micro-batch walks every virtual stage in order; no backward."""
    orders: list[list[Action]] = [[] for _ in range(num_stages)]
    for mb in range(num_microbatches):
        for virtual in range(num_stages * num_chunks):
            orders[host(virtual)].append(Action(ActionKind.FORWARD, virtual, mb))
    return orders
