"""Per-tensor states and the table of legal transitions between them.

ColossalAI silently ignores an illegal transition; here it raises, naming the tensor and both states, because an
illegal transition always means the driver (cx-zero's hooks) lost track of a parameter. A transition to the state a
tensor is already in is a legal no-op (a tied parameter used twice in one operation).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from cx_chunk._errors import IllegalTransitionError

__all__ = ["LEGAL_TRANSITIONS", "TensorState", "check_transition"]


class TensorState(enum.Enum):
    """Where a tensor is in a training step."""

    FREE = "free"  # storage not needed now (e.g. after the optimizer consumed its gradient)
    COMPUTE = "compute"  # used by the operation that is running
    HOLD = "hold"  # idle: values valid, not in use
    HOLD_AFTER_BWD = "hold_after_bwd"  # backward through it has finished; its gradient is being produced
    READY_FOR_REDUCE = "ready_for_reduce"  # its gradient is in place and may be reduced


_S = TensorState

LEGAL_TRANSITIONS: Mapping[TensorState, frozenset[TensorState]] = MappingProxyType(
    {
        _S.FREE: frozenset({_S.HOLD, _S.COMPUTE}),
        _S.HOLD: frozenset({_S.FREE, _S.COMPUTE}),
        _S.COMPUTE: frozenset({_S.HOLD, _S.HOLD_AFTER_BWD}),
        _S.HOLD_AFTER_BWD: frozenset({_S.COMPUTE, _S.READY_FOR_REDUCE}),
        _S.READY_FOR_REDUCE: frozenset({_S.HOLD}),
    }
)


def check_transition(tensor_name: str, current: TensorState, new: TensorState) -> None:
    """Raise `IllegalTransitionError` unless `current -> new` is in the table (or `current == new`)."""
    if current is new or new in LEGAL_TRANSITIONS[current]:
        return
    allowed = ", ".join(sorted(state.name for state in LEGAL_TRANSITIONS[current]))
    raise IllegalTransitionError(
        f"tensor {tensor_name!r}: illegal state transition {current.name} -> {new.name} "
        f"(from {current.name} the legal next states are: {allowed})"
    )
