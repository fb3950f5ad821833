"""Deterministic execution of per-stage action lists: deadlock check, makespan, bubble and activation memory.

Each stage runs its list in order; an action starts when its stage is free and the actions it depends on (the
previous virtual stage's forward, the next virtual stage's input-gradient backward, its own forward or `I`) have
finished. Costs are per action (unit by default), so the same lists can be compared under the costs a real model
has (a heavier last stage, a first stage whose `I` is empty and whose `W` is its whole backward). Transfers take no
time. Used by the tests (every schedule is deadlock-free), by the V order's construction and by the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cx_pipeline._actions import Action, ActionKind

__all__ = ["ActionCost", "SimulationResult", "dependencies", "simulate", "unit_cost"]

ActionCost = Callable[[Action], float]


def unit_cost(action: Action) -> float:
    """Every action takes one time slot (the textbook model behind `(p-1)/(m+p-1)`)."""
    return 1.0


@dataclass(frozen=True)
class SimulationResult:
    """One simulated step: its makespan, per stage the busy time, the peak of live forward activations and when
    each action started (the timeline drawn in docs/pipeline.md)."""

    makespan: float
    busy: tuple[float, ...]
    peak_live: tuple[int, ...]
    starts: tuple[tuple[tuple[float, Action], ...], ...]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stage-time rectangle, averaged over stages."""
        return 1.0 - sum(self.busy) / (self.makespan * len(self.busy))


def dependencies(action: Action, num_virtual: int) -> list[tuple[Action, ...]]:
    """What `action` waits for: a list of requirements, each satisfied by any one of its alternatives (the next
    virtual stage's backward is `B` or `I` depending on the schedule)."""
    v, mb = action.virtual_stage, action.microbatch
    if action.kind is ActionKind.FORWARD:
        return [] if v == 0 else [(Action(ActionKind.FORWARD, v - 1, mb),)]
    if action.kind is ActionKind.BACKWARD_WEIGHT:
        return [(Action(ActionKind.BACKWARD_INPUT, v, mb),)]
    needs: list[tuple[Action, ...]] = [(Action(ActionKind.FORWARD, v, mb),)]
    if v < num_virtual - 1:
        needs.append((Action(ActionKind.BACKWARD, v + 1, mb), Action(ActionKind.BACKWARD_INPUT, v + 1, mb)))
    return needs


def _live_change(action: Action) -> int:
    """Forward activations are held from `F` until the backward that frees them (`B`, or `W` when split)."""
    if action.kind is ActionKind.FORWARD:
        return 1
    if action.kind in (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT):
        return -1
    return 0


def simulate(orders: list[list[Action]], num_virtual: int, cost: ActionCost = unit_cost) -> SimulationResult:
    """Run the per-stage lists in order with `cost(action)` time per action (as the runtime does: it never reorders);
    raise if the schedule deadlocks."""
    finish: dict[Action, float] = {}
    position = [0] * len(orders)
    clock = [0.0] * len(orders)
    busy = [0.0] * len(orders)
    live = [0] * len(orders)
    peak = [0] * len(orders)
    starts: list[list[tuple[float, Action]]] = [[] for _ in orders]

    def run(stage: int, action: Action, start: float) -> None:
        took = cost(action)
        starts[stage].append((start, action))
        finish[action] = clock[stage] = start + took
        busy[stage] += took
        live[stage] += _live_change(action)
        peak[stage] = max(peak[stage], live[stage])

    remaining = sum(len(actions) for actions in orders)
    while remaining:
        progressed = False
        for stage, actions in enumerate(orders):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                start = clock[stage]
                for alternatives in dependencies(action, num_virtual):
                    done = [finish[a] for a in alternatives if a in finish]
                    if not done:
                        break
                    start = max(start, min(done))
                else:
                    run(stage, action, max(start, clock[stage]))
                    position[stage] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {s: orders[s][position[s]] for s in range(len(orders)) if position[s] < len(orders[s])}
            raise RuntimeError(f"pipeline schedule deadlocks: stages wait on {stuck}")
    makespan = max(clock) if orders else 0.0
    return SimulationResult(makespan, tuple(busy), tuple(peak), tuple(tuple(s) for s in starts))
