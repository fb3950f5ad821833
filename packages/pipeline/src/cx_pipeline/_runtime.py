"""Executes one rank's action list for one step: forwards, backwards (whole or split), transfers, loss bookkeeping.

The schedules differ only in their action lists (`_actions`); everything else lives here once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from cx_pipeline._actions import Action, ActionKind
from cx_pipeline._backward_split import WeightGrad, backward_input
from cx_pipeline._calling import call_arguments
from cx_pipeline._optimizer import no_sync_context
from cx_pipeline._p2p import StageTransport
from cx_pipeline._pytree import flatten, unflatten
from cx_pipeline._stage_manager import PipelineStageManager

__all__ = ["StepRunner"]

_GRAD_KINDS = (ActionKind.BACKWARD, ActionKind.BACKWARD_WEIGHT)


def _one_or_list(tensors: list[torch.Tensor]) -> Any:
    return tensors[0] if len(tensors) == 1 else tensors


class StepRunner:
    """State of one step on one rank."""

    def __init__(
        self,
        manager: PipelineStageManager,
        transport: StageTransport,
        chunks: Sequence[nn.Module],
        micro_batches: list[Any],
        criterion: Callable[[Any, Any], torch.Tensor] | None,
        optimizer: Any | None,
        keep_outputs: bool,
    ) -> None:
        self.manager = manager
        self.transport = transport
        self.chunks = chunks
        self.micro_batches = micro_batches
        self.criterion = criterion
        self.optimizer = optimizer
        self.keep_outputs = keep_outputs
        self.num_virtual = manager.num_virtual_stages
        self.loss: torch.Tensor | None = None
        self.outputs: dict[int, Any] = {}
        self._saved: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]] = {}
        self._weights: dict[tuple[int, int], Callable[[], None]] = {}

    def _host(self, virtual: int) -> int:
        return self.manager.locate_virtual_stage(virtual)[0]

    # ---- the step ---------------------------------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], defer_all_reductions: bool) -> None:
        """Run `actions` exactly as listed; with an optimizer that has `no_sync`, every gradient-producing action runs
        inside it except each chunk's last (so each parameter is reduced once per step), or all of them when
        `defer_all_reductions`.

        Nothing here reorders by timing (which messages have arrived): a `W` pass can run collectives (the tp
        all-reduces of a recomputed backward, ZeRO's reduction hooks), so the ranks of one tp or dp group must run
        their actions in the same order, and the order must be a function of the schedule alone.
        """
        no_sync = no_sync_context(self.optimizer)
        remaining: dict[int, int] = {}
        for action in actions:
            if action.kind in _GRAD_KINDS:
                chunk = self.manager.locate_virtual_stage(action.virtual_stage)[1]
                remaining[chunk] = remaining.get(chunk, 0) + 1

        self.transport.prefetch()
        for action in actions:
            chunk = self.manager.locate_virtual_stage(action.virtual_stage)[1]
            if action.kind in _GRAD_KINDS:
                remaining[chunk] -= 1
            deferred = no_sync is not None and (remaining.get(chunk, 0) > 0 or defer_all_reductions)
            context = no_sync() if no_sync is not None and deferred and action.kind is not ActionKind.FORWARD else None
            with context if context is not None else contextlib.nullcontext():
                if action.kind is ActionKind.FORWARD:
                    self._forward(action.virtual_stage, action.microbatch)
                elif action.kind is ActionKind.BACKWARD_WEIGHT:
                    self._weights.pop((action.virtual_stage, action.microbatch))()
                else:
                    self._backward(action.virtual_stage, action.microbatch, action.kind is ActionKind.BACKWARD_INPUT)
            self.transport.prune()
            self.transport.prefetch()
        self.transport.end_step()

    # ---- forward --------------------------------------------------------------------------------------------------
    def _receive_activation(self, virtual: int, mb: int) -> Any:
        if virtual == 0:
            return {}
        previous = self._host(virtual - 1)
        message = ("act", virtual, mb)
        if previous == self.manager.stage:
            return self.transport.take_local(message)
        return self.transport.receive(previous, message)

    def _forward(self, virtual: int, mb: int) -> None:
        stage, chunk_id = self.manager.locate_virtual_stage(virtual)
        received = self._receive_activation(virtual, mb)
        inputs = [leaf for leaf in flatten(received)[0] if leaf.requires_grad]
        micro_batch = self.micro_batches[mb]
        args, kwargs = call_arguments(micro_batch, received)
        with self.manager.switch_model_chunk_id(chunk_id):
            output = self.chunks[chunk_id](*args, **kwargs)
        grad_enabled = torch.is_grad_enabled()
        if virtual == self.num_virtual - 1:
            if self.keep_outputs:
                self.outputs[mb] = _detached(output)
            if self.criterion is None:
                return
            loss = self.criterion(output, micro_batch) / len(self.micro_batches)
            self.loss = loss.detach() if self.loss is None else self.loss + loss.detach()
            if grad_enabled:
                self._saved[(virtual, mb)] = (inputs, [loss], [])
            return
        leaves, meta = flatten(output, f"the output of virtual stage {virtual}")
        following = self._host(virtual + 1)
        if following == stage:
            handed = [leaf.detach().requires_grad_(leaf.is_floating_point() and grad_enabled) for leaf in leaves]
            self.transport.deliver_locally(("act", virtual + 1, mb), unflatten(meta, handed))
            self.transport.remember_sent(("grad", virtual, mb), leaves)
        else:
            self.transport.send_activation(following, ("act", virtual + 1, mb), output)
        if grad_enabled:
            floats = [leaf for leaf in leaves if leaf.is_floating_point()]
            self._saved[(virtual, mb)] = (inputs, floats, [])

    # ---- backward -------------------------------------------------------------------------------------------------
    def _output_grads(self, virtual: int, mb: int) -> list[torch.Tensor]:
        following = self._host(virtual + 1)
        message = ("grad", virtual, mb)
        if following == self.manager.stage:
            grads: list[torch.Tensor] = self.transport.take_local(message)
        else:
            grads = self.transport.receive(following, message)
        return grads

    def _backward(self, virtual: int, mb: int, split: bool) -> None:
        inputs, outputs, _ = self._saved.pop((virtual, mb))
        chunk_id = self.manager.locate_virtual_stage(virtual)[1]
        last = virtual == self.num_virtual - 1
        if last:
            grads: list[torch.Tensor] = [torch.ones_like(outputs[0])]
        else:
            received = self._output_grads(virtual, mb)
            pairs = [(o, g) for o, g in zip(outputs, received, strict=True) if o.requires_grad]
            outputs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        if split:
            input_grads = self._split_backward(virtual, mb, chunk_id, outputs, grads, inputs, last)
        else:
            self._full_backward(outputs, grads, last)
            input_grads = [x.grad for x in inputs]
        if virtual == 0:
            return
        filled = [g if g is not None else torch.zeros_like(x) for g, x in zip(input_grads, inputs, strict=True)]
        previous = self._host(virtual - 1)
        if previous == self.manager.stage:
            self.transport.deliver_locally(("grad", virtual - 1, mb), filled)
        else:
            self.transport.send_grads(previous, filled)

    def _full_backward(self, outputs: list[torch.Tensor], grads: list[torch.Tensor], last: bool) -> None:
        if not outputs:
            return
        if self.optimizer is None:
            torch.autograd.backward(outputs, grads)
        elif last:
            self.optimizer.backward(outputs[0])
        else:
            self.optimizer.backward_by_grad(_one_or_list(outputs), _one_or_list(grads))

    def _split_backward(
        self,
        virtual: int,
        mb: int,
        chunk_id: int,
        outputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        inputs: list[torch.Tensor],
        last: bool,
    ) -> list[torch.Tensor | None]:
        params = [p for p in self.chunks[chunk_id].parameters() if p.requires_grad]
        if self.optimizer is None:
            input_grads, weight = backward_input(outputs, grads, inputs, params)
            self._weights[(virtual, mb)] = WeightGrad.run.__get__(weight)
            return input_grads
        optimizer = self.optimizer
        if inputs and outputs:
            if last:
                optimizer.backward(outputs[0], inputs=inputs, retain_graph=True)
            else:
                optimizer.backward_by_grad(_one_or_list(outputs), _one_or_list(grads), inputs=inputs, retain_graph=True)

        def weight_pass() -> None:
            if not outputs or not params:
                return
            if last:
                optimizer.backward(outputs[0], inputs=params, retain_graph=False)
            else:
                optimizer.backward_by_grad(
                    _one_or_list(outputs), _one_or_list(grads), inputs=params, retain_graph=False
                )

        self._weights[(virtual, mb)] = weight_pass
        return [x.grad for x in inputs]


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, dict):
        try:
            return type(value)(**{k: _detached(v) for k, v in value.items()})
        except TypeError:
            return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_detached(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value
