"""Single-process pieces: micro-batch splitting and merging, the pytree metadata, the schedules' action lists
(deadlock-free, bubbles), and the split backward against a whole one."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn

from cx_pipeline import Action, ActionKind, PipelineConfigError, merge_microbatches, simulate, split_batch
from cx_pipeline._actions import interleaved_order, one_f_one_b_order
from cx_pipeline._backward_split import backward_input
from cx_pipeline._pytree import TreeMeta, flatten, unflatten
from cx_pipeline._runtime import StepRunner
from cx_pipeline._zbv_order import (
    greedy_v_order,
    handbuilt_v_order,
    v_reference_cost,
    zbv_order,
)


def test_split_and_merge_nested_batches() -> None:
    batch: dict[str, Any] = {
        "input_ids": torch.arange(12).reshape(6, 2),
        "extra": {"mask": torch.ones(6, 2)},
        "pair": (torch.zeros(6), 3),
    }
    parts = split_batch(batch, 3)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 2]
    assert parts[1]["pair"][1] == 3
    merged = merge_microbatches(parts)
    torch.testing.assert_close(merged["input_ids"], batch["input_ids"])
    torch.testing.assert_close(merged["extra"]["mask"], batch["extra"]["mask"])
    assert merged["pair"][1] == 3
    torch.testing.assert_close(merge_microbatches([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))


def test_split_rejects_disagreeing_batch_sizes() -> None:
    with pytest.raises(PipelineConfigError, match="same batch size"):
        split_batch({"a": torch.zeros(4), "b": torch.zeros(3)}, 2)
    with pytest.raises(PipelineConfigError, match="holds no tensors"):
        split_batch({"a": 1}, 1)


def test_pytree_metadata_round_trip() -> None:
    value = {
        "h": torch.randn(2, 3),
        "logits": (torch.randn(4, 2), torch.randn(4, 2)),
        "n": None,
        "ids": torch.ones(2, dtype=torch.long),
    }
    leaves, meta = flatten(value)
    again = TreeMeta.from_bytes(meta.to_bytes())
    assert again == meta
    assert [m.requires_grad for m in meta.leaves] == [True, True, True, False]  # float leaves carry gradients
    rebuilt = unflatten(again, leaves)
    assert rebuilt["n"] is None
    assert isinstance(rebuilt["logits"], tuple)
    with pytest.raises(TypeError, match="cannot travel"):
        flatten({"x": object()})


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_action_lists_are_deadlock_free(p: int, m: int) -> None:
    result = simulate(one_f_one_b_order(p, m), p)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))  # unit-time F and B
    zbv = simulate(zbv_order(p, m), 2 * p)
    assert sorted(zbv.busy) == [6 * m] * p  # every F, I and W of both chunks ran exactly once
    if m >= p:
        assert zbv.bubble_fraction < result.bubble_fraction
    if m % p == 0:
        simulate(interleaved_order(p, 2, m), 2 * p)


def test_simulation_with_costs() -> None:
    # 1F1B, 2 stages, 1 micro-batch, F = 1 and B = 2: F0 F1 B1 B0 run one after the other.
    result = simulate(one_f_one_b_order(2, 1), 2, lambda a: 1.0 if a.kind is ActionKind.FORWARD else 2.0)
    assert result.makespan == 6.0
    assert result.busy == (3.0, 3.0)
    assert result.bubble_fraction == pytest.approx(0.5)
    assert result.peak_live == (1, 1)
    backward_first = [[Action(ActionKind.BACKWARD, 0, 0), Action(ActionKind.FORWARD, 0, 0)], []]
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate(backward_first, 2)


def _benchmark_cost(num_virtual: int) -> Callable[[Action], float]:
    """Per-action milliseconds measured on benchmarks/pipeline's model (2 layers per chunk, one thread): the first
    virtual stage has the embedding and an empty I, the last one the head and the loss."""
    first = {ActionKind.FORWARD: 10.0, ActionKind.BACKWARD_INPUT: 0.5, ActionKind.BACKWARD_WEIGHT: 17.0}
    middle = {ActionKind.FORWARD: 8.4, ActionKind.BACKWARD_INPUT: 10.0, ActionKind.BACKWARD_WEIGHT: 9.0}
    last = {ActionKind.FORWARD: 14.0, ActionKind.BACKWARD_INPUT: 17.5, ActionKind.BACKWARD_WEIGHT: 16.0}

    def cost(action: Action) -> float:
        table = first if action.virtual_stage == 0 else last if action.virtual_stage == num_virtual - 1 else middle
        return table[action.kind]

    return cost


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("build", [handbuilt_v_order, greedy_v_order, zbv_order])
def test_v_orders_are_complete_and_valid(p: int, m: int, build: Callable[[int, int], list[list[Action]]]) -> None:
    orders = build(p, m)
    kinds = (ActionKind.FORWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT)
    for stage, actions in enumerate(orders):
        expected = {Action(k, v, mb) for k in kinds for v in (stage, 2 * p - 1 - stage) for mb in range(m)}
        assert len(actions) == len(expected)  # every F, I and W exactly once
        assert set(actions) == expected
        position = {a: i for i, a in enumerate(actions)}
        for a in actions:
            if a.kind is ActionKind.BACKWARD_WEIGHT:
                assert position[Action(ActionKind.BACKWARD_INPUT, a.virtual_stage, a.microbatch)] < position[a]
            if a.kind is not ActionKind.FORWARD and a.microbatch > 0:  # per virtual stage in micro-batch order
                assert position[Action(a.kind, a.virtual_stage, a.microbatch - 1)] < position[a]
    result = simulate(orders, 2 * p)  # raises on a deadlock: every cross-stage dependency can be met
    assert max(result.peak_live) <= 2 * p  # 1F1B's activation memory (2p half-stage chunks)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_v_order_is_no_slower_than_the_greedy_one(p: int, m: int) -> None:
    """The order cx runs never simulates slower than the greedy order it replaced, under the reference costs and
    under the benchmark model's measured costs; with at least as many micro-batches as stages it is faster there."""
    nv = 2 * p
    chosen, before = zbv_order(p, m), greedy_v_order(p, m)
    assert simulate(chosen, nv, v_reference_cost).makespan <= simulate(before, nv, v_reference_cost).makespan
    measured = _benchmark_cost(nv)
    if m >= p:
        assert simulate(chosen, nv, measured).makespan < simulate(before, nv, measured).makespan
    else:
        assert simulate(chosen, nv, measured).makespan <= simulate(before, nv, measured).makespan


def test_split_backward_equals_whole_backward() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 8, bias=False))
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    whole = x.clone().requires_grad_()
    net(whole).backward(g)
    expected = [p.grad.clone() for p in net.parameters() if p.grad is not None]
    net.zero_grad(set_to_none=True)
    split = x.clone().requires_grad_()
    out = net(split)
    input_grads, weight = backward_input([out], [g], [split], list(net.parameters()))
    assert all(p.grad is None for p in net.parameters())  # the input pass computed no weight gradient
    assert input_grads[0] is not None
    assert whole.grad is not None
    torch.testing.assert_close(input_grads[0], whole.grad)
    assert not weight.recomputes
    weight.run()
    for param, want in zip(net.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, want)


def test_split_backward_with_a_weight_used_twice_recomputes_correctly() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    x, g = torch.randn(4, 8), torch.randn(4, 8)
    whole = x.clone().requires_grad_()
    layer(torch.tanh(layer(whole))).backward(g)
    expected = [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    layer.zero_grad(set_to_none=True)
    split = x.clone().requires_grad_()
    input_grads, weight = backward_input([layer(torch.tanh(layer(split)))], [g], [split], list(layer.parameters()))
    assert weight.recomputes
    weight.run()
    assert whole.grad is not None
    assert input_grads[0] is not None
    torch.testing.assert_close(input_grads[0], whole.grad)
    for param, want in zip(layer.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, want)


def test_split_backward_groups_joined_through_a_third_source_do_not_count_twice() -> None:
    torch.manual_seed(0)
    p, q = nn.Parameter(torch.randn(6, 6)), nn.Parameter(torch.randn(6, 6))
    x, g = torch.randn(3, 6), torch.randn(3, 6)

    def f(inp: torch.Tensor) -> torch.Tensor:
        # sources: (inp @ q) feeds q, (h @ p) feeds p with q on its input side, (inp @ (p + q)) feeds both and
        # so joins all three in one group; no single source reaches a parameter along both of its sides
        return torch.tanh((inp @ q) @ p) + inp @ (p + q)

    whole = x.clone().requires_grad_()
    f(whole).backward(g)
    expected = [t.grad.clone() for t in (p, q) if t.grad is not None]
    p.grad = q.grad = None
    split = x.clone().requires_grad_()
    input_grads, weight = backward_input([f(split)], [g], [split], [p, q])
    weight.run()
    assert whole.grad is not None
    assert input_grads[0] is not None
    torch.testing.assert_close(input_grads[0], whole.grad)
    for param, want in zip((p, q), expected, strict=True):
        torch.testing.assert_close(param.grad, want)


class _FakeManager:
    """What `StepRunner` asks of a stage manager, for stage `stage` of a V over `num_stages` stages."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage, self.num_stages, self.num_virtual_stages = stage, num_stages, 2 * num_stages

    def locate_virtual_stage(self, virtual: int) -> tuple[int, int]:
        p = self.num_stages
        return (virtual, 0) if virtual < p else (2 * p - 1 - virtual, 1)


class _FakeTransport:
    """Overlapped p2p whose `ready` (has a neighbour's message arrived?) answers from `readiness`, as timing would."""

    overlap = True

    def __init__(self, readiness: Callable[[], bool]) -> None:
        self._readiness = readiness

    def ready(self, stage: int, message: Any) -> bool:
        return self._readiness()

    def prefetch(self) -> None:
        pass

    def prune(self) -> None:
        pass

    def end_step(self) -> None:
        pass


class _RecordingRunner(StepRunner):
    """A `StepRunner` whose compute only records which action ran (the split backward leaves a `W` to run)."""

    def __init__(self, manager: _FakeManager, transport: _FakeTransport) -> None:
        super().__init__(cast(Any, manager), cast(Any, transport), [], [], None, None, False)
        self.ran: list[Action] = []

    def _forward(self, virtual: int, mb: int) -> None:
        self.ran.append(Action(ActionKind.FORWARD, virtual, mb))

    def _backward(self, virtual: int, mb: int, split: bool) -> None:
        self.ran.append(Action(ActionKind.BACKWARD_INPUT if split else ActionKind.BACKWARD, virtual, mb))
        if split:
            weight = Action(ActionKind.BACKWARD_WEIGHT, virtual, mb)
            self._weights[(virtual, mb)] = lambda: self.ran.append(weight)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 2)])
def test_runtime_runs_the_v_order_as_listed_whatever_has_arrived(p: int, m: int) -> None:
    """The actions a rank runs are its schedule list, whatever the transport reports as arrived: a `W` can run tp
    collectives, so tp peers whose messages arrive at different times must still run the same sequence. (cx used to
    run pending `W`s while a message had not arrived; "never arrived" then ran them early.)"""
    rng = random.Random(0)
    readiness = {"always": lambda: True, "never": lambda: False, "random": lambda: rng.random() < 0.5}
    for stage, listed in enumerate(zbv_order(p, m)):
        for name, ready in readiness.items():
            runner = _RecordingRunner(_FakeManager(stage, p), _FakeTransport(ready))
            runner.run(listed, defer_all_reductions=False)
            assert runner.ran == listed, f"stage {stage}, messages arriving {name}"
