"""The per-step driver behind GeminiDDP's hooks: gather before use, release after, gradients into chunks.

Forward: a unit's pre-hook gathers its parameters' chunks (through the `ChunkScheduler`, which also prefetches and
applies the placement policy) and marks them COMPUTE; the post-hook marks them HOLD when no enclosing unit still
uses them and releases their chunks. Nested units share parameters, so uses are counted.
Backward: a hook on each unit's forward outputs gathers the unit again before autograd runs through it; each
parameter's post-accumulate-grad hook moves its gradient into the chunk's gradient buffer (autograd keeps none)
and, once every parameter of a chunk has its gradient, reduce-scatters that chunk and releases it. A sharded
chunk takes the gradients into its own gathered buffer (a parameter's values are dead once its gradient exists),
so backward holds one full-size buffer per chunk in flight, not two. A callback at
the end of backward checks that every rank produced gradients for the same parameters and issued the same chunk
collectives in the same order (a clear error instead of mixed collectives; the end of a forward is checked the
same way; the answer is read on the first three steps, then every 50: `_agreement`), then reduces the chunks whose
parameters were partly unused (missing gradients are zero).
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook

from cx_chunk import Chunk, ChunkManager, ChunkScheduler, TensorState
from cx_mesh import ProcessGroup, all_gather_bytes, get_accelerator
from cx_zero.gemini._agreement import DigestAgreement
from cx_zero.gemini._outputs import OpaqueOutputError, grad_tensors_in
from cx_zero.gemini._units import Unit

__all__ = ["GeminiDriver", "PathMismatchError"]

_S = TensorState


class PathMismatchError(RuntimeError):
    """Ranks of one data-parallel group used different parameters, or the same ones in a different order, in the
    same step."""


_KINDS = {"all_gather": "g", "reduce_scatter": "r", "all_reduce": "a"}
_KIND_NAMES = {v: k for k, v in _KINDS.items()}
_PHASES = {"forward": "used in forward", "backward": "given a gradient in backward"}


@dataclass(frozen=True)
class _Report:
    """What one rank did in a forward or a backward: the parameters it used (indices), the chunk collectives it
    issued in order (kind letter, chunk id), and the parameters unfrozen since wrapping."""

    used: tuple[int, ...]
    sequence: tuple[tuple[str, int], ...]
    unfrozen: tuple[int, ...]

    def encode(self) -> bytes:
        return "|".join(
            [
                ",".join(map(str, self.used)),
                ",".join(f"{kind}{chunk}" for kind, chunk in self.sequence),
                ",".join(map(str, self.unfrozen)),
            ]
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> _Report:
        used, sequence, unfrozen = raw.decode().split("|")
        return _Report(
            tuple(int(x) for x in used.split(",") if x),
            tuple((x[0], int(x[1:])) for x in sequence.split(",") if x),
            tuple(int(x) for x in unfrozen.split(",") if x),
        )


class GeminiDriver:
    """Owns the hook state of one GeminiDDP (see the module docstring)."""

    def __init__(
        self,
        manager: ChunkManager,
        scheduler: ChunkScheduler,
        units: Sequence[Unit],
        names: dict[int, str],
        *,
        check_groups: Sequence[ProcessGroup | None],
        eager_reduce: bool,
        allow_accumulation: bool,
    ) -> None:
        self.manager = manager
        self.scheduler = scheduler
        self.units = list(units)
        self.names = names
        self.check_groups = list(check_groups)
        self._agreement = DigestAgreement(self.check_groups)
        self.eager_reduce = eager_reduce
        self.allow_accumulation = allow_accumulation
        self.trainable = [p for unit in units for p in unit.params if p.requires_grad]
        self._ordered = self._unique(p for u in units for p in u.params)
        self._index = {id(p): i for i, p in enumerate(self._ordered)}
        self.frozen = [p for p in self._ordered if not p.requires_grad]  # at wrap time: chunks without gradients
        self._unfrozen: list[int] = []
        self._chunk_by_id = {chunk.chunk_id: chunk for chunk in manager.chunks()}
        self._sequence: list[tuple[str, int]] = []  # chunk collectives of the running forward or backward
        manager.on_collective = self._record
        self.broken: str | None = None
        self._uses: dict[int, int] = {}
        self._skipped: dict[int, list[bool]] = {}  # per module: whether each running call skipped (covered)
        self._in_step = False
        self._expect_backward = False
        self._in_backward = False
        self._forward_used: set[int] = set()
        self._grad_now: set[int] = set()  # parameters that received a gradient in the running backward
        self._reduced_now: set[int] = set()  # chunk ids reduced in the running backward
        self.has_grad: set[int] = set()  # parameters with a gradient since the last zero_grad
        self.grads_pending = False
        self._handles: list[Any] = []
        self._non_model = 0 if get_accelerator().name == "cpu" else None

    @staticmethod
    def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for p in params:
            seen.setdefault(id(p), p)
        return list(seen.values())

    # ------------------------------------------------------------------------------------------------ install
    def install(self) -> None:
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
        # held weakly: a tensor hook lives in C++, out of the garbage collector's sight, and a bound method would keep
        # this driver, its chunks and the model alive after the user dropped them
        owner = weakref.WeakMethod(self._post_accumulate)

        def post_accumulate(param: torch.Tensor) -> None:
            method = owner()
            if method is not None:
                method(param)

        for p in self._unique(self.trainable):
            self._handles.append(p.register_post_accumulate_grad_hook(post_accumulate))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.manager.on_collective = None

    def _record(self, kind: str, chunk: Chunk) -> None:
        self._sequence.append((_KINDS[kind], chunk.chunk_id))

    # ------------------------------------------------------------------------------------------------ steps
    def begin_forward(self) -> None:
        """Called by GeminiDDP.forward before the wrapped module runs."""
        if self.broken is not None:
            raise PathMismatchError(f"{self.broken} (this GeminiDDP is unusable after that error: rebuild it)")
        if self._in_backward:
            raise RuntimeError("GeminiDDP: forward called during backward")
        if self._expect_backward:  # the previous forward's graph was dropped without backward
            self._finish_step()
        self._forward_used = set()
        self._sequence = []
        self._unfrozen = [self._index[id(p)] for p in self.frozen if p.requires_grad]
        if not self._in_step:
            self.scheduler.begin_step()
            self._in_step = True

    def end_forward(self, output: object) -> None:
        """Called after the wrapped module ran: train steps wait for backward, others end here.

        The ranks compare what they used and the order of their chunk collectives (a training forward always; a
        forward without autograd when it issued collectives, which then must have paired up)."""
        try:
            wants_grad = torch.is_grad_enabled() and bool(grad_tensors_in(output, "<root>"))
        except OpaqueOutputError:
            self._finish_step()
            raise
        if not wants_grad:
            try:
                if self._sequence:
                    self._check_same(self._forward_used, "forward")
            finally:
                self._finish_step()
            return
        self._check_same(self._forward_used, "forward", self._unfrozen)
        self._expect_backward = True

    def abandon_forward(self) -> None:
        """The wrapped module raised: release everything so the model stays usable."""
        self._finish_step()

    def _finish_step(self) -> None:
        """Release every chunk not kept by the policy and close the scheduler's step."""
        self._finish_reductions()
        for chunk in self.manager.chunks():
            for tensor in chunk.tensors:
                if chunk.tensor_state(tensor) is _S.COMPUTE:
                    chunk.transition(tensor, _S.HOLD)
            if chunk.is_gathered:  # straight to the policy: the trace's "used next" does not span steps
                self.manager.mark_unused(chunk)
                self.scheduler.policy.after_use(self.manager, chunk)
        self._uses.clear()
        self._skipped.clear()
        self._expect_backward = False
        if self._in_step:
            self.scheduler.end_step()
            self._in_step = False

    # ---------------------------------------------------------------------------------------------- forward
    def _access(self, params: Sequence[nn.Parameter]) -> None:
        self.scheduler.access(params, non_model_bytes=self._non_model)

    def _make_pre_forward(self, unit: Unit) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            skipped = self._skipped.setdefault(id(module), [])
            if unit.covered and all(self._uses.get(id(p), 0) > 0 for p in unit.params):
                self._forward_used.update(self._index[id(p)] for p in unit.direct)
                skipped.append(True)  # the enclosing unit holds every parameter: nothing to gather or release
                return
            skipped.append(False)
            if not self._in_step:
                raise RuntimeError(
                    f"GeminiDDP: module {unit.name!r} was called outside GeminiDDP.forward; call the GeminiDDP "
                    "wrapper (its parameters are sharded and only gathered by the wrapper's hooks)"
                )
            self._access(unit.params)
            for p in unit.params:
                count = self._uses.get(id(p), 0)
                if count == 0:
                    self.manager.get_chunk(p).transition(p, _S.COMPUTE)
                self._uses[id(p)] = count + 1
            self._forward_used.update(self._index[id(p)] for p in unit.direct)

        return hook

    def _make_post_forward(self, unit: Unit) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._skipped[id(module)].pop():
                return
            done = []
            for p in unit.params:
                count = self._uses[id(p)] - 1
                self._uses[id(p)] = count
                if count == 0:
                    self.manager.get_chunk(p).transition(p, _S.HOLD)
                    done.append(p)
            if done:
                self.scheduler.release(done)
            if torch.is_grad_enabled():
                outputs = grad_tensors_in(output, unit.name)
                if outputs:
                    register_multi_grad_hook(outputs, lambda grads: self._pre_backward(unit), mode="any")

        return hook

    # --------------------------------------------------------------------------------------------- backward
    def _begin_backward(self) -> None:
        if torch.is_grad_enabled() and self._any_released():  # grad mode is on only in a create_graph backward
            raise RuntimeError(
                "GeminiDDP: a backward with create_graph=True (a gradient penalty, double backward) is not supported "
                "while parameters are sharded: the graph it builds reads parameters whose chunks are released after "
                "use. Keep every chunk gathered (strict_ddp_mode=True or shard_param_frac=0.0), or compute the "
                "input gradient without create_graph"
            )
        if self.grads_pending and not self.allow_accumulation:
            raise RuntimeError(
                "GeminiDDP: a second backward before optimizer.step()/zero_grad() accumulates gradients; pass "
                "enable_gradient_accumulation=True to GeminiDDP to allow it"
            )
        self._in_backward = True
        self._grad_now = set()
        self._reduced_now = set()
        self._sequence = []
        if not self._in_step:
            self.scheduler.begin_step()
            self._in_step = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _any_released(self) -> bool:
        """Whether the placement releases (shards or evicts) any parameter chunk between uses."""
        policy = self.scheduler.policy
        return any(not policy.keeps_gathered(chunk) for chunk in self.manager.chunks())

    def _pre_backward(self, unit: Unit) -> None:
        if not self._in_backward:
            self._begin_backward()
        params = [p for p in unit.params if id(p) not in self._grad_now]
        if not params:
            return
        self._finish_reductions()  # before gathering more: the reduction's buffers go first
        self._access(params)
        for p in params:
            self.manager.get_chunk(p).transition(p, _S.COMPUTE)

    def _post_accumulate(self, param: torch.Tensor) -> None:
        grad = param.grad
        param.grad = None
        if grad is None:
            return
        if not self._in_backward:
            self._begin_backward()
        if id(param) in self._grad_now:
            raise RuntimeError(
                f"GeminiDDP: parameter {self.names[id(param)]!r} received a second gradient in one backward pass "
                "(reentrant activation checkpointing or a custom autograd path); use "
                "torch.utils.checkpoint(..., use_reentrant=False)"
            )
        chunk = self.manager.get_chunk(param)
        if chunk.tensor_state(param) is not _S.COMPUTE:
            chunk.transition(param, _S.COMPUTE)
        if self._grad_into_buffer(chunk):
            self.manager.write_grad_in_buffer(param, grad)
        else:
            self.manager.accumulate_grad(param, grad)
        chunk.transition(param, _S.HOLD_AFTER_BWD)
        chunk.transition(param, _S.READY_FOR_REDUCE)
        self._grad_now.add(id(param))
        if self.eager_reduce and chunk.can_reduce:
            self._reduce(chunk)

    def _grad_into_buffer(self, chunk: Chunk) -> bool:
        """Whether a gradient goes into its parameter's slot of the gathered chunk (no second full-size buffer):
        for sharded chunks the policy releases after use, unless this backward started a gradient buffer."""
        if chunk.grads_in_buffer:
            return True
        return (
            chunk.is_gathered
            and chunk.shard_size != chunk.chunk_size
            and not self.scheduler.policy.keeps_gathered(chunk)
            and not self.manager.grad_chunk(chunk).is_gathered
        )

    def _reduce(self, chunk: Chunk) -> None:
        """Reduce a chunk whose gradients are complete. During backward a chunk holding them in its buffer is
        reduced asynchronously, overlapping backward until the next gather or reduction (one in flight at a
        time, never while another chunk is being gathered), and released when that completes."""
        overlap = self._in_backward and chunk.grads_in_buffer
        if overlap:  # the previous one has had a chunk's backward to complete in
            self._finish_reductions()
        self.manager.reduce_chunk(chunk, async_op=overlap)
        self._reduced_now.add(chunk.chunk_id)
        if not overlap:
            self.scheduler.release(chunk.tensors)

    def _finish_reductions(self) -> None:
        for done in self.manager.finish_reductions():
            self.scheduler.release(done.tensors)

    def _end_backward(self) -> None:
        try:
            self._finish_reductions()
            self._check_same({self._index[i] for i in self._grad_now}, "backward")
            for chunk in self.manager.chunks("param"):
                if chunk.chunk_id in self._reduced_now:
                    continue
                got = [t for t in chunk.tensors if id(t) in self._grad_now]
                if not got:
                    continue  # no rank produced a gradient here (checked above): nothing to reduce
                for tensor in chunk.tensors:
                    if id(tensor) in self._grad_now:
                        continue
                    state = chunk.tensor_state(tensor)
                    if state in (_S.HOLD, _S.FREE):
                        chunk.transition(tensor, _S.COMPUTE)
                    chunk.transition(tensor, _S.HOLD_AFTER_BWD)
                    chunk.transition(tensor, _S.READY_FOR_REDUCE)
                self._reduce(chunk)
            self.has_grad.update(self._grad_now)
            # a backward that gave no parameter a gradient (torch.autograd.grad(loss, inputs)) does not count
            self.grads_pending = self.grads_pending or bool(self._grad_now)
        finally:
            self._in_backward = False
            self._finish_step()

    def zero_grad(self) -> None:
        self.manager.zero_grad_chunks()
        self.has_grad.clear()
        self.grads_pending = False

    # ------------------------------------------------------------------------------------------ consistency
    def _check_same(self, used: set[int], phase: str, unfrozen: Sequence[int] = ()) -> None:
        """Every rank of the check groups must report the same parameter set and the same sequence of chunk
        collectives; otherwise name the difference. Parameters unfrozen since wrapping, on any rank, raise too."""
        mine = _Report(tuple(sorted(used)), tuple(self._sequence), tuple(sorted(unfrozen)))
        payload = mine.encode()
        digest = hashlib.sha256(payload).digest()
        for index, group in enumerate(self.check_groups):
            if torch.distributed.get_world_size(group) > 1:
                self._agreement.compare(index, digest, payload, phase)
        found = self._agreement.end_check()  # read on the first checks, then every READ_EVERY-th (`_agreement`)
        if found is not None:
            reports = [_Report.decode(raw) for raw in all_gather_bytes(found.payload, found.group)]
            if any(r.unfrozen for r in reports):
                self._raise_unfrozen(reports)
            late = f" (found {found.checks_ago} check(s) later)" if found.checks_ago else ""
            if len({r.used for r in reports}) > 1:
                self._broken(self._set_message([set(r.used) for r in reports], _PHASES[found.phase]) + late)
            self._broken(self._order_message([r.sequence for r in reports], found.phase) + late)
        if mine.unfrozen:
            self._raise_unfrozen([mine])

    def _broken(self, message: str) -> None:
        self.broken = message
        self._in_backward = False
        raise PathMismatchError(message)

    def _raise_unfrozen(self, reports: list[_Report]) -> None:
        names = sorted({self.names[id(self._ordered[i])] for r in reports for i in r.unfrozen})
        ranks = [rank for rank, r in enumerate(reports) if r.unfrozen] if len(reports) > 1 else None
        self._finish_step()
        raise RuntimeError(
            f"GeminiDDP: requires_grad=True was set on parameters {names} that were frozen when GeminiDDP wrapped "
            f"the module{f' (on group ranks {ranks})' if ranks else ''}: frozen parameters live in chunks without "
            "gradients, master weights or optimizer state, so they cannot start training later. Set requires_grad "
            "before wrapping (and give the parameters to the optimizer), or freeze them again"
        )

    def _set_message(self, sets: list[set[int]], what: str) -> str:
        union = set().union(*sets)
        common = set.intersection(*sets)
        differing = sorted(self.names[id(self._ordered[i])] for i in union - common)
        ranks = {rank: sorted(self.names[id(self._ordered[i])] for i in (s - common)) for rank, s in enumerate(sets)}
        return (
            f"GeminiDDP: ranks took different paths through the model: parameters {what} on some ranks but "
            f"not on others: {differing}; only-on-this-rank by group rank: {ranks}. Every rank of a "
            "data-parallel group must use the same parameters in a step (make the branch depend on data that "
            "is identical across ranks, or run unused branches with a zero contribution)"
        )

    def _order_message(self, sequences: list[tuple[tuple[str, int], ...]], phase: str) -> str:
        first = next(
            i
            for i in range(max(len(s) for s in sequences) + 1)
            if len({s[i] if i < len(s) else None for s in sequences}) > 1
        )
        seen = {
            rank: self._describe(s[first]) if first < len(s) else "no further collective"
            for rank, s in enumerate(sequences)
        }
        return (
            f"GeminiDDP: ranks used the same parameters in a different order in {phase}: their chunk collectives "
            "pair one chunk with another, so gathered parameters or reduced gradients are mixed. First difference "
            f"at collective {first} of the {phase}, by group rank: {seen}. Every rank of a data-parallel group "
            "must call its modules in the same order"
        )

    def _describe(self, entry: tuple[str, int]) -> str:
        kind, chunk_id = entry
        chunk = self._chunk_by_id.get(chunk_id)
        names = [self.names[id(t)] for t in chunk.tensors] if chunk is not None else []
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} parameters)" if len(names) > 3 else "")
        return f"{_KIND_NAMES[kind]} of chunk {chunk_id} [{shown}]"
