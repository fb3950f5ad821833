"""The boosted optimizers of HybridParallelPlugin.

zero_stage 0 (`HybridParallelOptimizer`): the user's torch optimizer steps fp32 master weights (the working
parameters themselves in fp32; fp32 copies of them in fp16/bf16) of the parameters this rank holds. Gradients
accumulate locally over the micro-batches and backward passes of a step and are averaged over the data-parallel
group once, with coalesced all-reduces (fp8 ones, E5M2, with fp8_communication), when the step (or a clip) first
needs them. That is why there is no torch DDP here (nor its fp8 comm hook): with pipelines, DDP would reduce once
per micro-batch unless every backward but the last ran under `no_sync`, and a tied parameter's last backward would
reduce before its stages summed it; one reduction after the schedule is correct for every schedule at the same
traffic.

fp16 loss scaling is one `DynamicGradScaler` per rank fed with the same global decision: the overflow test is the
gradient norm reduced over the tp and pp groups after the data-parallel average, so an inf/nan on any rank skips the
step on every rank and every scale stays equal. The gradient norm counts each element of the model once: a
tensor-parallel shard fully, a tp-replicated parameter with weight 1/tp, a parameter tied over k pipeline stages with
weight 1/k (so it equals `torch.nn.utils.clip_grad_norm_` on the unsplit model).

zero_stage 1/2 (`HybridZeroOptimizer`): cx_zero's LowLevelZeroOptimizer over the data-parallel group does the same
(loss scaling, reduction, clipping), its norm reduced over the dp, tp and pp groups; a whole-tensor optimizer (Muon)
steps each parameter whole on a dp owner (cx_zero's `_whole_step`) and, with tp > 1, each split matrix whole on a tp
owner among those (`_tp_zero_whole`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cx_mesh import ProcessGroup, all_reduce
from cx_mesh.fp8 import all_reduce_fp8
from cx_plugins._tp_whole import TensorParallelWholeStep
from cx_plugins.hybrid._tp_zero_whole import ZeroTensorParallelWhole
from cx_plugins.wrappers._base import OptimizerWrapper, finite_or_raise
from cx_plugins.wrappers._zero import ZeroOptimizerWrapper
from cx_shardformer import get_shard_spec
from cx_zero import BaseGradScaler, LossScaleOptions, LowLevelZeroOptimizer, NormType, clip_coefficient, reduce_norm

__all__ = ["HybridParallelOptimizer", "HybridZeroOptimizer", "weighted_norm_term"]

_MASTER_KEY = "master_weight"  # cx_zero's key for fp32 masters in a by-name state dict


def weighted_norm_term(grads: Sequence[tuple[torch.Tensor, float]], norm_type: NormType) -> torch.Tensor:
    """This rank's contribution to the global norm: sum of weight * |g|^2 (2-norm) or max |g| (inf-norm), as an
    fp32 CPU scalar; a nan becomes +inf so that a MAX or SUM reduction always carries it."""
    if norm_type is NormType.INF:
        values = [g.detach().abs().max().float().cpu() for g, _ in grads if g.numel()]
        term = torch.stack(values).max() if values else torch.zeros(())
    else:
        values = [g.detach().float().pow(2).sum().cpu() * w for g, w in grads if g.numel()]
        term = torch.stack(values).sum() if values else torch.zeros(())
    return torch.nan_to_num(term, nan=math.inf, posinf=math.inf)


class HybridParallelOptimizer(OptimizerWrapper):
    """zero_stage 0: fp32 masters, optional fp16 loss scaling, one data-parallel reduction per step (module docs)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        held: Sequence[nn.Parameter],
        names: Mapping[int, str],
        dtype: torch.dtype,
        loss_scale: LossScaleOptions,
        max_norm: float,
        dp_group: ProcessGroup | None,
        norm_groups: Sequence[ProcessGroup | None],
        norm_weights: Mapping[int, float],
        bucket_cap_mb: float,
        reduce_groups: Mapping[int, ProcessGroup | None] | None = None,
        fp8_communication: bool = False,
        whole_tensors_over: ProcessGroup | None = None,
    ) -> None:
        super().__init__(optimizer)
        if optimizer.state:
            raise ValueError(
                "HybridParallelPlugin and MoeHybridParallelPlugin need a fresh optimizer (its parameters are repointed "
                "at boost); load earlier state afterwards"
            )
        held_ids = {id(p) for p in held}
        self._working: list[nn.Parameter] = []
        self._master_of: dict[int, torch.Tensor] = {}
        self._names = dict(names)
        self._mixed = dtype != torch.float32
        for group in optimizer.param_groups:
            chosen = []
            for param in group["params"]:
                if id(param) not in held_ids or not param.requires_grad:
                    continue  # another pipeline stage's parameter (freed here) or a frozen one
                master = param.detach().float().clone().requires_grad_(True) if self._mixed else param
                self._working.append(param)
                self._master_of[id(param)] = master
                chosen.append(master)
            group["params"] = chosen
        self.grad_scaler: BaseGradScaler = loss_scale.scaler(dynamic=dtype == torch.float16)
        self._fp16 = dtype == torch.float16
        self.max_norm = max_norm
        self._dp_group = dp_group
        self._reduce_groups = dict(reduce_groups or {})  # id -> another group to average over (MoE experts: moe_dp)
        self._norm_groups = [g for g in norm_groups if g is not None]  # None would mean the world
        self._weights = dict(norm_weights)
        self._bucket_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
        self._fp8 = fp8_communication  # the averaging all-reduce in fp8 (E5M2, cx_mesh.fp8)
        self._reduced = False
        self._grad_norm: float | None = None
        # a matrix-wise optimizer (Muon) over tp slices: whole matrices stepped on owner ranks (`_tp_whole`)
        self._tp_whole: TensorParallelWholeStep | None = None
        if whole_tensors_over is not None:
            sliced = [(self._master_of[id(p)], spec) for p in self._working if (spec := get_shard_spec(p)) is not None]
            self._tp_whole = TensorParallelWholeStep(optimizer, sliced, whole_tensors_over)

    # ---- backward -----------------------------------------------------------------------------------------------
    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, inputs: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Backward of `loss` (times the loss scale in fp16); the data-parallel reduction waits for the step."""
        self._before_backward()
        if self._fp16:
            loss = loss.float() * self.grad_scaler.scale
        torch.autograd.backward(loss, retain_graph=retain_graph, inputs=inputs)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> None:
        """Backward from a pipeline stage's output with the gradient received (already loss-scaled)."""
        self._before_backward()
        torch.autograd.backward(tensor, grad, inputs=inputs, retain_graph=retain_graph)

    def _before_backward(self) -> None:
        if self._reduced:
            raise RuntimeError(
                "backward after the gradients were already averaged for this step (by clip_grad_by_* or step): call "
                "zero_grad() after step() before the next backward"
            )

    # ---- the once-per-step reduction -----------------------------------------------------------------------------
    def _reduce(self) -> None:
        """Average the held gradients over their group (once per step): the data-parallel group, or the one
        `reduce_groups` names for a parameter. Groups are visited in the order of their first parameter, the same on
        every rank."""
        if self._reduced:
            return
        self._reduced = True
        by_group: dict[int, tuple[ProcessGroup | None, list[nn.Parameter]]] = {id(self._dp_group): (self._dp_group, [])}
        for param in self._working:
            group = self._reduce_groups.get(id(param), self._dp_group)
            by_group.setdefault(id(group), (group, []))[1].append(param)
        for group, params in by_group.values():
            if group is not None and dist.get_world_size(group) > 1:
                self._average(params, group)

    def _average(self, params: list[nn.Parameter], group: ProcessGroup) -> None:
        """Average `params`' gradients over `group`; a gradient missing here but present elsewhere counts as 0
        (e.g. an expert no token reached on this rank). The flags are read only on a rank that lacks a gradient: one
        holding them all already knows every parameter is used somewhere (no host read in the usual step, issue 37)."""
        if not params:
            return  # the same on every rank of the group: the same model
        device = params[0].device
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=device)
        all_reduce(used, op=dist.ReduceOp.MAX, group=group)
        grads: list[torch.Tensor] = []
        mine = [p.grad for p in params]
        anywhere_flags = [True] * len(params) if all(g is not None for g in mine) else used.tolist()
        for param, anywhere in zip(params, anywhere_flags, strict=True):
            if anywhere and param.grad is None:
                param.grad = torch.zeros_like(param)
            if anywhere and param.grad is not None:
                grads.append(param.grad)
        size = dist.get_world_size(group)
        for bucket in _buckets(grads, self._bucket_bytes):
            flat = _flatten_dense_tensors(bucket)
            if self._fp8:
                all_reduce_fp8(flat, group=group)
            else:
                all_reduce(flat, group=group)
            flat.div_(size)
            for grad, value in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
                grad.copy_(value)

    def _global_norm(self, norm_type: NormType) -> float:
        """The norm of the (still loss-scaled) gradients of the whole model, each element counted once."""
        pairs = [(p.grad, self._weights.get(id(p), 1.0)) for p in self._working if p.grad is not None]
        if norm_type is NormType.INF:
            pairs = [(g, 1.0) for g, _ in pairs]
        term = weighted_norm_term(pairs, norm_type)
        return float(reduce_norm(term, norm_type, self._norm_groups))

    # ---- step ---------------------------------------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> None:
        """Average the gradients over dp, skip on an fp16 overflow anywhere, unscale and clip, step the masters."""
        if closure is not None:
            raise ValueError(f"{type(self).__name__}.step does not take a closure: backward first, then step()")
        self._reduce()
        scale = self.grad_scaler.scale
        need_norm = self._fp16 or self.max_norm > 0
        scaled_norm = self._global_norm(NormType.TWO) if need_norm else math.nan
        overflow = self._fp16 and not math.isfinite(scaled_norm)
        self.grad_scaler.update(overflow)
        if overflow:
            self.zero_grad()
            return
        factor = 1.0 / scale
        if self.max_norm > 0:
            self._grad_norm = scaled_norm / scale
            factor *= clip_coefficient(self._grad_norm, self.max_norm)
        elif need_norm:
            self._grad_norm = scaled_norm / scale
        for param in self._working:
            master = self._master_of[id(param)]
            if param.grad is None:
                master.grad = None
                continue
            grad = param.grad.float() if self._mixed else param.grad
            master.grad = grad.mul_(factor) if factor != 1.0 else grad
        if self._tp_whole is not None:
            self._tp_whole.gather_grads()
        self.optim.step()
        if self._tp_whole is not None:
            self._tp_whole.scatter_masters()
        if self._mixed:
            with torch.no_grad():
                for param in self._working:
                    param.copy_(self._master_of[id(param)])
        for param in self._working:
            self._master_of[id(param)].grad = None
        self._reduced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self._working:
            if set_to_none or param.grad is None:
                param.grad = None
            else:
                param.grad.zero_()
            self._master_of[id(param)].grad = None
        self._reduced = False

    # ---- clipping between backward and step -----------------------------------------------------------------------
    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Scale the gradients so that their global norm (every tp shard, pp stage, tied parameter once; unscaled)
        is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_` on one process; returns that norm."""
        if not max_norm > 0 or math.isinf(max_norm):
            raise ValueError(f"clip_grad_by_norm: max_norm must be a positive number, got {max_norm}")
        self._reduce()
        kind = NormType.parse(norm_type)
        norm = self._global_norm(kind) / self.grad_scaler.scale
        coefficient = clip_coefficient(norm, max_norm)
        if math.isfinite(norm) and coefficient < 1.0:
            grads = [p.grad for p in self._working if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coefficient)
        return finite_or_raise(norm, error_if_nonfinite and not self._fp16)

    def clip_grad_by_value(self, clip_value: float) -> None:
        """Clamp every unscaled gradient element into [-clip_value, clip_value] (an fp16 overflow is left for the
        step to skip)."""
        if not clip_value > 0 or math.isinf(clip_value):
            raise ValueError(f"clip_grad_by_value: clip_value must be a positive number, got {clip_value}")
        self._reduce()
        if self._fp16 and not math.isfinite(self._global_norm(NormType.TWO)):
            return
        bound = clip_value * self.grad_scaler.scale
        for param in self._working:
            if param.grad is not None:
                param.grad.clamp_(-bound, bound)

    # ---- introspection ------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale

    def get_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last step (when it was computed: fp16 or max_norm > 0)."""
        return self._grad_norm

    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """id(working parameter) -> its fp32 master (the parameter itself when it is already fp32)."""
        return {id(p): self._master_of[id(p)] for p in self._working}

    def get_master_to_working_map(self) -> dict[int, nn.Parameter]:
        """id(fp32 master) -> its working parameter: the inverse of `get_working_to_master_map` (ColossalAI's
        mixed-precision optimizer has both; scripts use this one to write masters back into the model)."""
        return {id(self._master_of[id(p)]): p for p in self._working}

    def update_master_params(self, model: nn.Module) -> None:
        """Copy the working parameters (e.g. freshly loaded) into the fp32 masters."""
        with torch.no_grad():
            for param in self._working:
                master = self._master_of[id(param)]
                if master is not param:
                    master.copy_(param)
        if self._tp_whole is not None:
            self._tp_whole.refresh_wholes()

    # ---- state by parameter name (checkpoint IO's face) ------------------------------------------------------
    def state_dict_by_name(self) -> dict[str, Any]:
        """This rank's optimizer state keyed by parameter name (local tp shards; no communication), the param
        groups by name and the loss scaler, in LowLevelZeroOptimizer.state_dict()'s layout."""
        by_master = {id(self._master_of[id(p)]): self._names[id(p)] for p in self._working}
        # a whole-tensor optimizer over tp slices: each rank's slice of the owner's state (collective over tp)
        sliced = self._tp_whole.local_states(self.optim) if self._tp_whole is not None else {}
        slice_of = self._tp_whole.master_of_whole() if self._tp_whole is not None else {}
        state: dict[str, dict[str, Any]] = {}
        for param in self._working:
            master = self._master_of[id(param)]
            own = sliced[id(master)] if id(master) in sliced else self.optim.state.get(master, {})
            entry = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in own.items()}
            if self._mixed:
                entry[_MASTER_KEY] = master.detach().clone()
            if entry:
                state[self._names[id(param)]] = entry
        groups = [
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [by_master[id(slice_of.get(id(m), m))] for m in group["params"]],
            }
            for group in self.optim.param_groups
        ]
        return {"state": state, "param_groups": groups, "grad_scaler": self.grad_scaler.state_dict()}

    def load_state_dict_by_name(self, state_dict: Mapping[str, Any]) -> None:
        """Load what `state_dict_by_name` produced (with this rank's tp shards) into the torch optimizer."""
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise KeyError(f"optimizer state dict needs a {key!r} entry, got {sorted(state_dict)}")
        by_name = {self._names[id(p)]: self._master_of[id(p)] for p in self._working}
        slice_of = self._tp_whole.master_of_whole() if self._tp_whole is not None else {}
        index: dict[int, int] = {}  # id(master slice) -> position in the param groups
        whole_at: dict[int, int] = {}  # id(whole master) -> position (a whole-tensor optimizer over tp slices)
        inner_groups = []
        for group, saved in zip(self.optim.param_groups, state_dict["param_groups"], strict=True):
            ids = []
            for tensor in group["params"]:
                position = len(index)
                index[id(slice_of.get(id(tensor), tensor))] = position
                if id(tensor) in slice_of:
                    whole_at[id(tensor)] = position
                ids.append(position)
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        inner_state: dict[int, dict[str, Any]] = {}
        sliced: dict[int, dict[str, Any]] = {}  # id(master slice) -> its saved slice of a whole-tensor state
        sliced_ids = {id(m) for m in slice_of.values()}
        for name, entry in state_dict["state"].items():
            master = by_name.get(name)
            if master is None:
                continue  # a parameter of another pipeline stage
            values = dict(entry)
            saved_master = values.pop(_MASTER_KEY, None)
            if saved_master is not None and self._mixed:
                with torch.no_grad():
                    master.copy_(saved_master)
            if id(master) in sliced_ids:
                sliced[id(master)] = values
            else:
                inner_state[index[id(master)]] = values
        if self._tp_whole is not None:
            for whole_id, full in self._tp_whole.whole_states(sliced).items():
                inner_state[whole_at[whole_id]] = full
            self._tp_whole.refresh_wholes()
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        if "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(dict(state_dict["grad_scaler"]))

    def state_dict(self) -> dict[str, Any]:
        return self.state_dict_by_name()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.load_state_dict_by_name(state_dict)


def _buckets(grads: Sequence[torch.Tensor], limit: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype/device gradients of at most `limit` bytes (one all-reduce each)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if bucket and (size + nbytes > limit or grad.dtype != bucket[0].dtype or grad.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        yield bucket


class HybridZeroOptimizer(ZeroOptimizerWrapper):
    """zero_stage 1/2: LowLevelZeroOptimizer over the data-parallel group, with the by-name state dict face; with
    `tp_whole`, a whole-tensor optimizer's tp slices stepped whole on tp owner ranks (`_tp_zero_whole`)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        zero: LowLevelZeroOptimizer,
        tp_whole: ZeroTensorParallelWhole | None = None,
    ) -> None:
        super().__init__(optimizer, zero)
        self.tp_whole = tp_whole

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Used by the pipeline schedules: every backward of a step but the last accumulates without reducing."""
        return self.zero.no_sync()

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, inputs: Sequence[torch.Tensor] | None = None
    ) -> None:
        self.zero.backward(loss, retain_graph=retain_graph, inputs=inputs)

    def update_master_params(self, model: torch.nn.Module) -> None:
        super().update_master_params(model)
        if self.tp_whole is not None:
            self.tp_whole.refresh()

    def state_dict_by_name(self) -> dict[str, Any]:
        """Optimizer state by name, full over dp (collective over dp, and tp with `tp_whole`), this rank's tp
        shards."""
        if self.tp_whole is not None:
            return self.tp_whole.state_dict(self.zero.state_dict)
        return self.zero.state_dict()

    def load_state_dict_by_name(self, state_dict: Mapping[str, Any]) -> None:
        if self.tp_whole is not None:
            self.tp_whole.load_state_dict(lambda: self.zero.load_state_dict(state_dict))
        else:
            self.zero.load_state_dict(state_dict)

    def state_dict(self) -> dict[str, Any]:
        return self.state_dict_by_name()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.load_state_dict_by_name(state_dict)
