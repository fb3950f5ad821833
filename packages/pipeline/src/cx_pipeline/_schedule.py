"""`PipelineSchedule`: what every schedule shares (ColossalAI's `forward_backward_step`), over an action list.

A subclass says which stage managers it runs with, which micro-batch counts it accepts, and its action lists.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from cx_pipeline._actions import Action, forward_only_order
from cx_pipeline._errors import EmptyDataIterError, PipelineConfigError
from cx_pipeline._microbatch import batch_size_of, merge_microbatches, resolve_num_microbatches, split_batch
from cx_pipeline._model import PipelineModel, SharedParameter
from cx_pipeline._optimizer import no_sync_context
from cx_pipeline._p2p import StageTransport
from cx_pipeline._probe import AGREE_STEPS, agree_to_probe, batch_signature, probe
from cx_pipeline._runtime import StepRunner
from cx_pipeline._stage_manager import PipelineStageManager
from cx_pipeline._ties import TiedGradients

__all__ = ["PipelineSchedule"]

_NO_BATCH = object()  # what next() returns from an exhausted data iterator


def _positive_or_none(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise PipelineConfigError(f"{name} must be a positive integer or None, got {value!r}")


class PipelineSchedule(ABC):
    """Base of the schedules: splits the batch, probes the stages once, runs this rank's actions, returns the loss."""

    #: Whether the schedule splits each backward into input- and weight-gradient passes.
    splits_backward = False

    def __init__(
        self,
        stage_manager: PipelineStageManager,
        num_microbatches: int | None,
        microbatch_size: int | None,
        enable_metadata_cache: bool = True,
        overlap_p2p: bool = True,
        fp8_communication: bool = False,
    ) -> None:
        _positive_or_none("num_microbatches", num_microbatches)
        _positive_or_none("microbatch_size", microbatch_size)
        if num_microbatches is None and microbatch_size is None:
            raise PipelineConfigError("give num_microbatches or microbatch_size (num_microbatches wins when both are)")
        self.stage_manager = stage_manager
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.enable_metadata_cache = enable_metadata_cache
        self.overlap_p2p = overlap_p2p
        #: Activations (E4M3) and gradients (E5M2) sent between stages as fp8 with their scales (ColossalAI's switch).
        self.fp8_communication = fp8_communication
        self._check_stage_manager(stage_manager)
        self._transport = StageTransport(
            stage_manager.stage_ranks,
            stage_manager.stage,
            stage_manager.pp_group,
            enable_metadata_cache,
            overlap=overlap_p2p,
            fp8_communication=fp8_communication,
        )
        self._probed: str | None = None
        self._agreed = 0  # steps that agreed on probing (`AGREE_STEPS`)
        self._fingerprint: tuple[str, int] | None = None  # this stage's batch signature and micro-batch count
        self._orders_cache: dict[tuple[int, bool], list[list[Action]]] = {}

    # ---- what subclasses define -----------------------------------------------------------------------------------
    @abstractmethod
    def _check_stage_manager(self, manager: PipelineStageManager) -> None:
        """Raise `PipelineConfigError` for a stage manager laid out for another schedule."""

    def _check_microbatches(self, num_microbatches: int) -> None:  # noqa: B027 (optional hook: most accept any count)
        """Raise `PipelineConfigError` for a micro-batch count this schedule cannot run."""

    @abstractmethod
    def _orders(self, num_microbatches: int) -> list[list[Action]]:
        """Every stage's action list for one step (uncached)."""

    # ---- shared machinery -----------------------------------------------------------------------------------------
    def orders(self, num_microbatches: int, forward_only: bool = False) -> list[list[Action]]:
        """Every stage's action list for a step of `num_microbatches` (cached)."""
        key = (num_microbatches, forward_only)
        if key not in self._orders_cache:
            manager = self.stage_manager
            if forward_only:

                def host(virtual: int) -> int:
                    return manager.locate_virtual_stage(virtual)[0]

                orders = forward_only_order(manager.num_stages, manager.num_model_chunks, num_microbatches, host)
            else:
                orders = self._orders(num_microbatches)
            self._orders_cache[key] = orders
        return self._orders_cache[key]

    def _unpack(self, model: nn.Module) -> tuple[list[nn.Module], list[SharedParameter]]:
        if isinstance(model, PipelineModel):
            chunks, shared = list(model.chunks), model.shared
        elif isinstance(model, nn.ModuleList) and not _runs_itself(model, self.stage_manager.num_model_chunks):
            chunks, shared = list(model), []
        else:
            chunks, shared = [model], []
        expected = self.stage_manager.num_model_chunks
        if len(chunks) != expected:
            raise PipelineConfigError(
                f"{type(self).__name__} runs {expected} model chunk(s) per stage, but this stage was given "
                f"{len(chunks)}; pass an nn.ModuleList (or PipelineModel) with one module per chunk"
            )
        return chunks, shared

    def microbatch_count(self, batch: Any) -> int:
        """How many micro-batches `batch` splits into, validated for this schedule."""
        count = resolve_num_microbatches(batch_size_of(batch), self.num_microbatches, self.microbatch_size)
        self._check_microbatches(count)
        return count

    def forward_backward_step(
        self,
        model_chunk: nn.Module,
        data_iter: Iterator[Any] | Iterable[Any],
        criterion: Callable[[Any, Any], torch.Tensor] | None,
        optimizer: Any | None = None,
        return_loss: bool = False,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """Run one step over the next batch of `data_iter`: forwards and backwards of every micro-batch.

        The loss (the mean of `criterion(outputs, micro_batch)` over micro-batches) and the merged outputs are
        returned on the rank holding the last virtual stage, None elsewhere. Under `torch.no_grad()` only forwards
        run (evaluation). Gradients accumulate into `.grad` (or go through `optimizer`'s backward when given).
        """
        chunks, shared = self._unpack(model_chunk)
        iterator = data_iter if isinstance(data_iter, Iterator) else iter(data_iter)
        batch = next(iterator, _NO_BATCH)
        if batch is _NO_BATCH:
            raise EmptyDataIterError(
                "the pipeline step's data iterator is empty or exhausted: each step (booster.execute_pipeline or "
                "forward_backward_step) takes one batch from it, split into micro-batches; pass an iterator with a "
                "batch left for this step (e.g. a fresh iter(dataloader) each epoch, with as many steps as batches)"
            )
        count = self.microbatch_count(batch)
        forward_only = not torch.is_grad_enabled()
        if not forward_only and criterion is None:
            raise PipelineConfigError("training needs a criterion(outputs, micro_batch) for the last stage")
        if not forward_only and optimizer is not None:
            self._check_optimizer(optimizer)
        micro_batches = split_batch(batch, count)
        signature = batch_signature(micro_batches[0])
        fingerprint = (signature, count)
        # Issue 37: the agreement (a collective and a host read) runs on the first steps and when this stage's batch
        # changes; with the same data on every stage (the plugins' loaders) they all see a change at the same step.
        if self._agreed < AGREE_STEPS or fingerprint != self._fingerprint:
            if agree_to_probe(self.stage_manager, self._transport.device, signature != self._probed, count):
                probe(self.stage_manager, self._transport, chunks, micro_batches[0], criterion)
                self._probed = signature
            self._agreed += 1
            self._fingerprint = fingerprint

        manager = self.stage_manager
        orders = self.orders(count, forward_only)

        def host(virtual: int) -> int:
            return manager.locate_virtual_stage(virtual)[0]

        self._transport.plan(orders, manager.num_virtual_stages, host)
        runner = StepRunner(
            manager,
            self._transport,
            chunks,
            micro_batches,
            criterion,
            None if forward_only else optimizer,
            return_outputs,
        )
        ties = [s for s in shared if s.group is not None]
        # A parameter must be reduced once: with ties across stages (summed first) or a parameter in two of this
        # rank's chunks (two "last backwards"), every backward defers and one flush reduces at the end.
        seen: set[int] = set()
        shared_locally = False
        for chunk in chunks:
            ids = {id(p) for p in chunk.parameters()}
            shared_locally |= bool(ids & seen)
            seen |= ids
        defer = (bool(ties) or shared_locally) and no_sync_context(optimizer) is not None
        # The ties' gradients from earlier steps (accumulation before one optimizer step) wait aside, so that only
        # this step's contribution is summed over the stages.
        tied = TiedGradients([] if forward_only else ties)
        try:
            runner.run(orders[manager.stage], defer_all_reductions=defer)
        except BaseException:
            tied.restore()
            raise
        if not forward_only:
            tied.reduce()
            if defer:
                _reduce_accumulated(chunks, optimizer)
        holds_loss = host(manager.num_virtual_stages - 1) == manager.stage
        outputs = [runner.outputs[mb] for mb in sorted(runner.outputs)] if return_outputs and holds_loss else []
        return {
            "loss": runner.loss if return_loss and holds_loss else None,
            "outputs": merge_microbatches(outputs) if outputs else None,
        }

    def _check_optimizer(self, optimizer: Any) -> None:
        for name in ("backward", "backward_by_grad"):
            if not callable(getattr(optimizer, name, None)):
                raise PipelineConfigError(
                    f"the optimizer passed to forward_backward_step needs a {name}() method (ColossalAI's "
                    f"OptimizerWrapper contract); {type(optimizer).__name__} has none. Pass optimizer=None to "
                    "accumulate plain .grad instead"
                )


def _reduce_accumulated(chunks: list[nn.Module], optimizer: Any) -> None:
    """After every backward ran under `no_sync` and the tied gradients were summed, let the optimizer reduce what
    accumulated: a zero gradient through every parameter that has one fires its gradient hooks outside no_sync."""
    params = list({id(p): p for chunk in chunks for p in chunk.parameters() if p.grad is not None}.values())
    if not params:
        return
    anchor = torch.stack([p.reshape(-1)[0].float() for p in params]).sum()
    optimizer.backward_by_grad(anchor, torch.zeros_like(anchor))


def _runs_itself(model: nn.ModuleList, num_model_chunks: int) -> bool:
    """A ModuleList subclass with its own `forward`, given where one chunk per stage runs, is that one chunk (as
    ColossalAI's 1F1B calls it); a plain ModuleList, or any list where several chunks run, lists the chunks."""
    return num_model_chunks == 1 and type(model).forward is not nn.ModuleList.forward
