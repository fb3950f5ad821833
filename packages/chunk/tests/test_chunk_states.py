"""The per-tensor state machine: every legal transition passes, illegal ones raise naming tensor and both states."""

from __future__ import annotations

import itertools

import pytest
import torch

from cx_chunk import LEGAL_TRANSITIONS, Chunk, IllegalTransitionError, TensorState, check_transition
from cx_mesh.testing import distributed

S = TensorState
EXPECTED_LEGAL = {
    (S.FREE, S.HOLD),
    (S.FREE, S.COMPUTE),
    (S.HOLD, S.FREE),
    (S.HOLD, S.COMPUTE),
    (S.COMPUTE, S.HOLD),
    (S.COMPUTE, S.HOLD_AFTER_BWD),
    (S.HOLD_AFTER_BWD, S.COMPUTE),
    (S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE),
    (S.READY_FOR_REDUCE, S.HOLD),
}
ALL_PAIRS = [(a, b) for a, b in itertools.product(S, S) if a is not b]


def test_chunk_states_table_is_the_documented_one() -> None:
    table = {(a, b) for a, targets in LEGAL_TRANSITIONS.items() for b in targets}
    assert table == EXPECTED_LEGAL
    assert set(LEGAL_TRANSITIONS) == set(S)


@pytest.mark.parametrize(("current", "new"), sorted(EXPECTED_LEGAL, key=str))
def test_chunk_states_legal_transition_passes(current: TensorState, new: TensorState) -> None:
    check_transition("w", current, new)


@pytest.mark.parametrize("state", list(S))
def test_chunk_states_same_state_is_a_no_op(state: TensorState) -> None:
    check_transition("w", state, state)


@pytest.mark.parametrize(("current", "new"), [p for p in ALL_PAIRS if p not in EXPECTED_LEGAL])
def test_chunk_states_illegal_transition_names_tensor_and_states(current: TensorState, new: TensorState) -> None:
    with pytest.raises(IllegalTransitionError, match=rf"'layer1.weight'.*{current.name} -> {new.name}"):
        check_transition("layer1.weight", current, new)


@distributed(world_size=1)
def test_chunk_states_drive_release_and_reduce(rank: int, world_size: int) -> None:
    a, b = torch.ones(3), torch.ones(2)
    chunk = Chunk(6, torch.float32)
    chunk.append(a, name="a")
    chunk.append(b, name="b")
    chunk.close()
    assert chunk.state_counts()[S.HOLD] == 2
    assert chunk.can_release
    assert not chunk.can_reduce
    # a forward/backward cycle through the table
    for state in (S.COMPUTE, S.HOLD, S.COMPUTE, S.HOLD_AFTER_BWD):
        chunk.transition(a, state)
        assert chunk.can_release == (state is S.HOLD)
    chunk.transition(a, S.READY_FOR_REDUCE)
    assert not chunk.can_reduce  # b is not ready
    for state in (S.COMPUTE, S.HOLD_AFTER_BWD, S.READY_FOR_REDUCE):
        chunk.transition(b, state)
    assert chunk.state_counts()[S.READY_FOR_REDUCE] == 2
    assert bool(chunk.can_reduce)
    with pytest.raises(IllegalTransitionError, match=r"'b': illegal state transition READY_FOR_REDUCE -> COMPUTE"):
        chunk.transition(b, S.COMPUTE)
    assert chunk.tensor_state(b) is S.READY_FOR_REDUCE  # a refused transition changes nothing
    chunk.gather()
    chunk.reduce()
    assert chunk.state_counts()[S.HOLD] == 2
    chunk.transition(a, S.FREE)
    assert chunk.can_release
