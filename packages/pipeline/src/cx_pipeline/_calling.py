"""How a stage is called, and the checks the probe forward applies to what stages send each other.

Every stage receives the whole micro-batch (ColossalAI's convention: an attention mask or labels are needed on more
than the first stage) plus what the previous stage sent: `chunk(**micro_batch, **received)` for a dict batch,
`chunk(micro_batch, **received)` for a tensor, `chunk(*micro_batch, **received)` for a list or tuple. A stage that
is not the last returns a dict: its entries become the next stage's keyword arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["call_arguments", "check_stage_output", "signature_problem"]


def call_arguments(micro_batch: Any, received: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(micro_batch, Mapping):
        clash = sorted(set(micro_batch) & set(received))
        if clash:
            raise ValueError(
                f"the previous stage sends {clash}, which the micro-batch also holds; rename the stage output"
            )
        return (), {**micro_batch, **received}
    if isinstance(micro_batch, list | tuple):
        return tuple(micro_batch), dict(received)
    return (micro_batch,), dict(received)


def signature_problem(chunk: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why `chunk.forward` cannot take these arguments, or None when it can."""
    try:
        signature = inspect.signature(chunk.forward)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        return f"{type(chunk).__name__}.forward{signature} cannot take them: {error}"
    return None


def check_stage_output(output: Any) -> str | None:
    """Why the output of a stage that is not the last cannot be handed to the next stage, or None."""
    if not isinstance(output, Mapping):
        return (
            f"it returned a {type(output).__name__}; a stage that is not the last must return a dict, whose entries "
            "the next stage receives as keyword arguments"
        )
    keys = [key for key in output if not isinstance(key, str)]
    if keys:
        return f"its output dict has non-string keys {keys}"
    return None
