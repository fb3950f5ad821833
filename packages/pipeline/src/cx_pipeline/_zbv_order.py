"""Action orders for the zero-bubble V schedule (two chunks per stage; chunk 0 of stage `s` is virtual stage `s`,
chunk 1 is `2p - 1 - s`; backward split into `I`, input gradients, and `W`, weight gradients).

Two constructions, and `zbv_order` takes whichever finishes first in the simulator under `v_reference_cost`:

- `handbuilt_v_order`, the ZB-V order of the zero-bubble paper (Qi et al. 2024, section 6): a fixed warm-up that
  fills the V, a steady state alternating chunk 0 and chunk 1 with each `I` followed by its `W`, and a cool-down that
  pushes the `W`s to the end. It is built for at least `2p - 1` micro-batches; with fewer, it is built for `2p - 1`
  and the missing micro-batches' actions are dropped (that keeps every dependency and cannot deadlock: a wait cycle
  among the kept actions would have been one in the full order). Best when `m >= p`.
- `greedy_v_order`, a list schedule simulated slot by slot with unit costs: a ready `I` first, else a ready forward
  while fewer than `2p` chunk-activations are alive, else a pending `W`. Best when `m < p`, where the hand-built
  order's dropped micro-batches leave holes.

With unit costs both reach the same bubble for `m >= p` at two stages, but a real model's stages are not uniform:
stage 0 holds the embedding (virtual stage 0, whose `I` is empty and whose `W` is its whole backward) and the head and
loss (the last virtual stage). Under those costs the hand-built order keeps stage 0 busy (measured costs of the
benchmark model: 300 vs 308 time units at p = 2, m = 4; 617 vs 653 at p = 4, m = 8).
"""

from __future__ import annotations

import functools

from cx_pipeline._actions import Action, ActionKind
from cx_pipeline._simulation import dependencies, simulate

__all__ = ["greedy_v_order", "handbuilt_v_order", "uses_handbuilt_order", "v_reference_cost", "zbv_order"]

_F, _I, _W = ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT


def _host(virtual: int, num_stages: int) -> int:
    return virtual if virtual < num_stages else 2 * num_stages - 1 - virtual


def v_reference_cost(action: Action) -> float:
    """Costs `zbv_order` compares orders with: F, I and W of one chunk take one unit each, except on virtual stage 0,
    which has no input gradient to compute (`I` is free) and whose `W` is the whole backward (two units)."""
    if action.virtual_stage == 0 and action.kind is _I:
        return 0.0
    if action.virtual_stage == 0 and action.kind is _W:
        return 2.0
    return 1.0


class _StageOrder:
    """One stage's list under construction: per (kind, chunk) counters give each new action its micro-batch."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self.virtual = (stage, 2 * num_stages - 1 - stage)
        self.count = {(kind, chunk): 0 for kind in (_F, _I, _W) for chunk in (0, 1)}
        self.actions: list[Action] = []

    def add(self, kind: ActionKind, chunk: int) -> None:
        self.actions.append(Action(kind, self.virtual[chunk], self.count[(kind, chunk)]))
        self.count[(kind, chunk)] += 1

    def backward(self, chunk: int) -> None:
        self.add(_I, chunk)
        self.add(_W, chunk)


def handbuilt_v_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The zero-bubble paper's ZB-V order (see the module docstring)."""
    p, m = num_stages, num_microbatches
    built = max(m, 2 * p - 1)
    orders = []
    for stage in range(p):
        order = _StageOrder(stage, p)
        # Warm-up: fill the down-stroke of the V, then interleave chunk 1's first forwards as they arrive, then the
        # first chunk-1 micro-batches turn round at once (their gradient comes straight back up the V).
        for _ in range(2 * (p - stage) - 1):
            order.add(_F, 0)
        for _ in range(stage):
            order.add(_F, 1)
            order.add(_F, 0)
        for _ in range(p - stage):
            order.add(_F, 1)
            order.backward(1)
        # Steady state: one forward and one backward of each chunk in turn until every forward ran.
        while order.count[(_F, 1)] < order.count[(_F, 0)] or order.count[(_F, 0)] < built:
            if order.count[(_F, 0)] < built:
                order.add(_F, 0)
            order.backward(0)
            order.add(_F, 1)
            order.backward(1)
        # Cool-down: input gradients first (the stages before wait for them), weight gradients fill the tail.
        for _ in range(stage):
            order.add(_I, 0)
            order.add(_I, 1)
        for _ in range(p - stage):
            order.backward(0)
        for chunk in (1, 0):
            while order.count[(_W, chunk)] < order.count[(_I, chunk)]:
                order.add(_W, chunk)
        if any(count != built for count in order.count.values()):  # pragma: no cover - construction invariant
            raise AssertionError(f"V order of stage {stage} is incomplete: {order.count}")
        orders.append([action for action in order.actions if action.microbatch < m])
    return orders


def greedy_v_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """A unit-time list schedule of the V (see the module docstring); any `m >= 1`."""
    p, m = num_stages, num_microbatches
    num_virtual = 2 * p
    limit = 2 * p
    mine = [sorted((v for v in range(num_virtual) if _host(v, p) == s), reverse=True) for s in range(p)]
    next_forward = dict.fromkeys(range(num_virtual), 0)
    next_backward = dict.fromkeys(range(num_virtual), 0)
    pending_weight: list[list[Action]] = [[] for _ in range(p)]
    live = [0] * p
    done: set[Action] = set()
    orders: list[list[Action]] = [[] for _ in range(p)]

    def ready(action: Action) -> bool:
        return all(any(a in done for a in alts) for alts in dependencies(action, num_virtual))

    total = num_virtual * m * 3
    while len(done) < total:
        finished: list[Action] = []
        for stage in range(p):
            # deeper virtual stage first: it is closer to the loss
            backwards = [Action(_I, v, next_backward[v]) for v in mine[stage] if next_backward[v] < m]
            choice = next((a for a in backwards if ready(a)), None)
            if choice is None and live[stage] < limit:
                forwards = [Action(_F, v, next_forward[v]) for v in mine[stage] if next_forward[v] < m]
                choice = next((a for a in forwards if ready(a)), None)
            if choice is None and pending_weight[stage]:
                choice = pending_weight[stage].pop(0)
            if choice is None:
                continue
            if choice.kind is _F:
                next_forward[choice.virtual_stage] += 1
                live[stage] += 1
            elif choice.kind is _I:
                next_backward[choice.virtual_stage] += 1
                pending_weight[stage].append(Action(_W, choice.virtual_stage, choice.microbatch))
            else:
                live[stage] -= 1
            orders[stage].append(choice)
            finished.append(choice)
        if not finished:
            raise RuntimeError(f"zero-bubble V order generation stalled (num_stages={p}, num_microbatches={m})")
        done.update(finished)
    return orders


@functools.lru_cache(maxsize=64)
def uses_handbuilt_order(num_stages: int, num_microbatches: int) -> bool:
    """Whether `zbv_order` is the hand-built order: unless the greedy one finishes sooner under `v_reference_cost`."""
    num_virtual = 2 * num_stages
    greedy = simulate(greedy_v_order(num_stages, num_microbatches), num_virtual, v_reference_cost).makespan
    return greedy >= simulate(handbuilt_v_order(num_stages, num_microbatches), num_virtual, v_reference_cost).makespan


def zbv_order(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """The V order cx runs, each rank its list exactly as listed (see `uses_handbuilt_order`).

    A function of (num_stages, num_microbatches) alone: a `W` can run tp collectives, so moving one by timing (as cx
    did while waiting for a message) could pair the collectives of a tp group's ranks wrongly.
    """
    if uses_handbuilt_order(num_stages, num_microbatches):
        return handbuilt_v_order(num_stages, num_microbatches)
    return greedy_v_order(num_stages, num_microbatches)
