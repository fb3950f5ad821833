"""The schedules as data: for every stage, the ordered list of compute actions it runs in one step.

A schedule is a function (num_stages, num_microbatches, ...) -> per-stage lists of `Action`s over *virtual stages*.
Every rank computes every stage's list (they are deterministic), which is how a receiver knows the order in which a
neighbour sends its messages. `simulate` executes the lists with unit-time actions to prove a schedule free of
deadlock and to measure its bubble; the zero-bubble V order is produced by that same simulation, greedily.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "Action",
    "ActionKind",
    "SimulationResult",
    "forward_only_order",
    "interleaved_order",
    "one_f_one_b_order",
    "simulate",
    "zbv_order",
]


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


@dataclass(frozen=True)
class SimulationResult:
    """Unit-time execution of a schedule: its makespan and, per stage, the busy slots."""

    makespan: int
    busy: tuple[int, ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stage-time rectangle, averaged over stages."""
        return 1.0 - sum(self.busy) / (self.makespan * len(self.busy))


def _ready(action: Action, done: set[Action], num_virtual: int) -> bool:
    v, mb = action.virtual_stage, action.microbatch
    if action.kind is ActionKind.FORWARD:
        return v == 0 or Action(ActionKind.FORWARD, v - 1, mb) in done
    if action.kind is ActionKind.BACKWARD_WEIGHT:
        return Action(ActionKind.BACKWARD_INPUT, v, mb) in done
    if Action(ActionKind.FORWARD, v, mb) not in done:
        return False
    if v == num_virtual - 1:
        return True
    return any(Action(kind, v + 1, mb) in done for kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT))


def simulate(orders: list[list[Action]], num_virtual: int) -> SimulationResult:
    """Run the per-stage lists with every action taking one time slot; raise if the schedule deadlocks."""
    position = [0] * len(orders)
    done: set[Action] = set()
    busy = [0] * len(orders)
    time = 0
    while any(position[s] < len(orders[s]) for s in range(len(orders))):
        finished = []
        for stage, actions in enumerate(orders):
            if position[stage] < len(actions) and _ready(actions[position[stage]], done, num_virtual):
                finished.append(actions[position[stage]])
                position[stage] += 1
                busy[stage] += 1
        if not finished:
            stuck = {s: orders[s][position[s]] for s in range(len(orders)) if position[s] < len(orders[s])}
            raise RuntimeError(f"pipeline schedule deadlocks at slot {time}: stages wait on {stuck}")
        done.update(finished)
        time += 1
    return SimulationResult(time, tuple(busy))


def zbv_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The zero-bubble V order, built by simulating the pipeline with unit-time F, I (input grad) and W (weight grad).

    Each stage holds virtual stages `s` and `2p-1-s`. In every slot a stage runs, in priority: a ready input-grad
    backward (it unblocks the stage before), else a ready forward while its live activations stay under `2p`
    chunk-activations (1F1B's memory), else a pending weight-grad pass (W fills what would be bubbles). Forwards and
    backwards of one virtual stage keep micro-batch order.
    """
    p, m = num_stages, num_microbatches
    num_virtual = 2 * p
    limit = 2 * p

    def host(virtual: int) -> int:
        return virtual if virtual < p else num_virtual - 1 - virtual

    mine = [[virtual for virtual in range(num_virtual) if host(virtual) == s] for s in range(p)]
    next_forward = {v: 0 for v in range(num_virtual)}
    next_backward = {v: 0 for v in range(num_virtual)}
    pending_weight: list[list[Action]] = [[] for _ in range(p)]
    live = [0] * p
    done: set[Action] = set()
    orders: list[list[Action]] = [[] for _ in range(p)]
    total = num_virtual * m * 3
    while len(done) < total:
        finished: list[Action] = []
        for stage in range(p):
            choice: Action | None = None
            # deeper virtual stage first: it is closer to the loss
            for virtual in sorted(mine[stage], reverse=True):
                mb = next_backward[virtual]
                candidate = Action(ActionKind.BACKWARD_INPUT, virtual, mb)
                if mb < m and _ready(candidate, done, num_virtual):
                    choice = candidate
                    break
            if choice is None and live[stage] < limit:
                for virtual in sorted(mine[stage], reverse=True):
                    mb = next_forward[virtual]
                    candidate = Action(ActionKind.FORWARD, virtual, mb)
                    if mb < m and _ready(candidate, done, num_virtual):
                        choice = candidate
                        break
            if choice is None and pending_weight[stage]:
                choice = pending_weight[stage].pop(0)
            if choice is None:
                continue
            if choice.kind is ActionKind.FORWARD:
                next_forward[choice.virtual_stage] += 1
                live[stage] += 1
            elif choice.kind is ActionKind.BACKWARD_INPUT:
                next_backward[choice.virtual_stage] += 1
                pending_weight[stage].append(
                    Action(ActionKind.BACKWARD_WEIGHT, choice.virtual_stage, choice.microbatch)
                )
            else:
                live[stage] -= 1
            orders[stage].append(choice)
            finished.append(choice)
        if not finished:
            raise RuntimeError(f"zero-bubble V order generation stalled (num_stages={p}, num_microbatches={m})")
        done.update(finished)
    return orders
