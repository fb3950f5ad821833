"""`LowLevelZeroOptimizer`: ZeRO-1/2 around any elementwise torch optimizer, over one or several DP groups.

Parameters stay whole on every rank (the "working" parameters the model computes with). Each trainable parameter is
assigned to one process group (`pg_to_param_list`; default: all over `dp_process_group` or the world), flattened,
padded and split over it (see `_partition`); the wrapped optimizer steps only this rank's master shards. Gradients
are reduced in fixed buckets (`_buckets`, `_reduce`) at the end of `backward` (or during it with
`overlap_communication` or stage 2), the step runs on the shards, and the updated shards are all-gathered back into
the working parameters (`_gather`), optionally finished lazily before the next forward (`overlap_allgather`).
With `fp8_communication` (ColossalAI's switch) both collectives, and the all-reduce over `extra_dp_group`, go through
`cx_mesh.fp8`: gradients as E5M2, parameters as E4M3; the masters stay full precision.
An optimizer whose update needs whole matrices (torch's Muon, or one passed to `declare_whole_tensor`) steps each
parameter whole on one owner rank instead, from the gathered gradient, the result scattered back into the shards
(`_whole_step`); the param groups it declares elementwise (`elementwise_groups`: MuonWithAdamW's AdamW groups) still
step on the shards, in the same `step()` of the wrapped optimizer.
A group with a single replica skips all of that (`_local`): its gradients are used where they are, and in fp32 (no
offload) its masters are the working parameters themselves. Parameter maps and state dicts: `_low_level_state`.

Global decisions (inf/nan overflow and the gradient norm, one reduction of the summed squares) are reduced over the
group that spans all the others (the dense DP group when experts use a sub-group) and over the TP/PP groups when
given, never over an unrelated group. Whether a parameter received a gradient travels with the gradient buckets, so
every rank of its group agrees, and a parameter no rank used is skipped by the optimizer exactly as torch skips a
parameter whose `.grad` is None.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup, assert_same_across_ranks, get_dist_logger, require_initialized
from cx_zero._bf16_states import Bf16StateAdam, require_bf16_capable
from cx_zero._buckets import plan_buckets
from cx_zero._clipping import ClipOptions
from cx_zero._comm import group_ranks
from cx_zero._device_norm import device_clip_coefficient, device_norm_or_inf
from cx_zero._elementwise import elementwise_groups, require_elementwise_or_whole
from cx_zero._gather import DeferredGathers, GroupGatherer
from cx_zero._grad_scaler import BaseGradScaler
from cx_zero._local import LocalGatherer, LocalReducer, local_master
from cx_zero._loss_scale import LossScaleOptions
from cx_zero._low_level_state import LowLevelStateMixin
from cx_zero._norm import NormType, clip_coefficient, norm_or_inf
from cx_zero._options import LowLevelZeroOptions, ZeroStage
from cx_zero._partition import ParamShard
from cx_zero._pick import pick_options
from cx_zero._reduce import GroupReducer
from cx_zero._setup import decide_working_dtype, group_params, parameter_names, trainable_params
from cx_zero._whole_step import WholeTensorStep

__all__ = ["LowLevelZeroOptimizer"]

_HOOK_ATTRIBUTE = "_cx_zero_grad_hook"  # the handle of the gradient hook of the optimizer that owns a parameter


class LowLevelZeroOptimizer(LowLevelStateMixin):
    """ZeRO stage 1 (`partition_grad=False`) or 2 (`partition_grad=True`) with ColossalAI's arguments.

    cx additions (keyword-only): `module` (an `nn.Module` or a name -> parameter mapping) names parameters in state
    dicts (otherwise they are keyed by their position, as strings); `norm_type` (2 or inf) for the gradient norm
    and clipping; `options` (a `LowLevelZeroOptions`, instead of the option keywords: what a plugin builds once from
    its own arguments); `tp_process_group` / `pp_process_group` join the
    gradient-norm and overflow reductions when the model is also split by tensor or pipeline parallelism;
    `grad_norm_weights` (id(param) -> weight, default 1) weighs a parameter's squared norm so that one replicated
    over k ranks of those groups (a tp-replicated norm weight, an embedding tied over k stages) counts once (1/k).
    The parameter maps and state dicts come from `LowLevelStateMixin` (module `_low_level_state`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pg_to_param_list: Mapping[ProcessGroup, list[nn.Parameter]] | None = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 2,
        max_scale: float = 2**24,
        clip_grad_norm: float = 0.0,
        verbose: bool = False,
        reduce_bucket_size: int = 1024 * 1024,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = False,
        partition_grad: bool = False,
        cpu_offload: bool = False,
        dp_process_group: ProcessGroup | None = None,
        extra_dp_group: ProcessGroup | None = None,
        forced_dtype: torch.dtype | None = None,
        master_weights: bool = True,
        overlap_allgather: bool = False,
        *,
        module: nn.Module | Mapping[str, torch.Tensor] | None = None,
        norm_type: float | str = 2.0,
        tp_process_group: ProcessGroup | None = None,
        pp_process_group: ProcessGroup | None = None,
        fp8_communication: bool = False,
        options: LowLevelZeroOptions | None = None,
        grad_norm_weights: Mapping[int, float] | None = None,
    ) -> None:
        from_keywords = LowLevelZeroOptions(
            loss_scale=LossScaleOptions(
                initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale
            ),
            clipping=ClipOptions.of(clip_grad_norm, norm_type, name="clip_grad_norm"),
            verbose=verbose,
            reduce_bucket_size=reduce_bucket_size,
            communication_dtype=communication_dtype,
            overlap_communication=overlap_communication,
            stage=ZeroStage.TWO if partition_grad else ZeroStage.ONE,
            cpu_offload=cpu_offload,
            forced_dtype=forced_dtype,
            master_weights=master_weights,
            overlap_allgather=overlap_allgather,
            fp8_communication=fp8_communication,
        )
        options = pick_options(options, from_keywords, LowLevelZeroOptions(), "LowLevelZeroOptimizer")
        require_initialized("LowLevelZeroOptimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"LowLevelZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        whole_tensors = require_elementwise_or_whole(optimizer, "LowLevelZeroOptimizer")
        # the parameters stepped whole: those of the groups that are not elementwise (all of them for torch's Muon)
        stepped_whole = {
            id(p)
            for group, elementwise in zip(optimizer.param_groups, elementwise_groups(optimizer), strict=True)
            if not elementwise
            for p in group["params"]
        }
        bf16_states = options.optimizer_states_dtype == torch.bfloat16
        if bf16_states:  # Adam's moments only: a whole-tensor optimizer (Muon) is refused here by name
            require_bf16_capable(optimizer, "LowLevelZeroOptimizer(optimizer_states_dtype=bf16)")
        if optimizer.state:
            raise ValueError(
                "LowLevelZeroOptimizer needs a fresh optimizer (its state is partitioned at construction); "
                "load earlier state afterwards with load_state_dict"
            )
        if pg_to_param_list is not None and dp_process_group is not None:
            raise ValueError("give either dp_process_group or pg_to_param_list, not both")
        if pg_to_param_list is not None and extra_dp_group is not None:
            raise ValueError(
                "extra_dp_group is supported only with a single dp_process_group, not with pg_to_param_list"
            )
        self.options = options
        self.optim = optimizer
        self._logger = get_dist_logger()

        trainable = trainable_params(optimizer)
        self._working_dtype = decide_working_dtype(trainable, options.forced_dtype)
        self._master_dtype = torch.float32 if options.master_weights else self._working_dtype
        if bf16_states and self._master_dtype != torch.float32:
            raise ValueError(
                f"LowLevelZeroOptimizer: optimizer_states_dtype=bf16 steps fp32 master weights, but the masters are "
                f"{self._master_dtype} (master_weights=False): keep master_weights=True"
            )
        self._fp16 = self._working_dtype == torch.float16
        # Built (and its arguments checked) before anything is changed: a failed construction must leave the
        # wrapped optimizer pointing at the model's parameters, so that it can be wrapped again.
        self.grad_scaler: BaseGradScaler = options.loss_scale.scaler(dynamic=self._fp16)
        names = parameter_names(trainable, module)
        groups = group_params(trainable, pg_to_param_list, dp_process_group)

        self._shards: list[ParamShard] = []
        self._shard_of: dict[int, ParamShard] = {}
        self._groups: list[ProcessGroup | None] = []
        self._group_shards: list[list[ParamShard]] = []
        self._reducers: list[GroupReducer | LocalReducer] = []
        self._gatherers: list[GroupGatherer | LocalGatherer] = []
        position = {id(p): i for i, p in enumerate(trainable)}
        for group in [g for g, _ in groups] + [extra_dp_group]:
            if group is not None and dist.get_rank(group) < 0:
                raise ValueError(
                    f"rank {dist.get_rank()} is not a member of a process group given to LowLevelZeroOptimizer "
                    f"(ranks {group_ranks(group)}): pass each rank its own groups"
                )
        for group_index, (group, params) in enumerate(groups):
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            assert_same_across_ranks(
                (repr(self.options), [(tuple(p.shape), str(p.dtype)) for p in params]),
                group,
                "LowLevelZeroOptimizer options and parameter shapes",
            )
            device = torch.device("cpu") if options.cpu_offload else params[0].device if params else torch.device("cpu")
            # one replica of this group's partition: nothing to reduce or gather (see `_local`)
            single = size == 1 and (extra_dp_group is None or dist.get_world_size(extra_dp_group) == 1)
            alias = single and not options.cpu_offload
            shards = []
            for param in params:
                master = local_master(param, self._master_dtype, device, alias, size, rank)
                shard = ParamShard(position[id(param)], names[id(param)], param, master, group_index, size, rank)
                shards.append(shard)
                self._shard_of[id(param)] = shard
            comm_dtype = options.communication_dtype or self._working_dtype
            self._groups.append(group)
            self._group_shards.append(shards)
            if single:
                self._reducers.append(LocalReducer(shards, comm_dtype, self._master_dtype, device))
                self._gatherers.append(LocalGatherer(shards))
                continue
            buckets = plan_buckets(list(reversed(shards)), self.options.reduce_bucket_size)
            self._reducers.append(
                GroupReducer(
                    group,
                    buckets,
                    self.options.stage,
                    comm_dtype,
                    self._master_dtype,
                    device,
                    extra_dp_group,
                    fp8=options.fp8_communication,
                )
            )
            self._gatherers.append(GroupGatherer(group, buckets, self._working_dtype, fp8=options.fp8_communication))
        self._shards = sorted(self._shard_of.values(), key=lambda s: s.index)
        self._spanning_index = self._spanning_group_index()
        spanning = self._groups[self._spanning_index]
        self._norm_groups = [spanning] + [g for g in (tp_process_group, pp_process_group) if g is not None]
        weights = grad_norm_weights or {}
        self._norm_weight = {id(s): float(weights.get(id(s.working), 1.0)) for s in self._shards}

        for param_group in optimizer.param_groups:
            param_group["params"] = [self._shard_of[id(p)].master for p in param_group["params"] if p.requires_grad]
        # bf16 moments: each shard's rounding bits differ by parameter and by rank (`_bf16_states`)
        salts = {id(s.master): s.index * 1_000_033 + s.group_rank for s in self._shards}
        self._bf16_states = Bf16StateAdam(optimizer, options.stochastic_rounding_seed, salts) if bf16_states else None
        # a matrix-wise optimizer (Muon) steps whole parameters on owner ranks instead of the shards (`_whole_step`);
        # its elementwise groups' parameters (MuonWithAdamW's AdamW groups) step on the shards
        self._whole: WholeTensorStep | None = None
        self._shard_of_optimizer_param = {id(s.master): s for s in self._shards}
        self._on_shards = [s for s in self._shards if id(s.working) not in stepped_whole]
        whole_shards = [s for s in self._shards if id(s.working) in stepped_whole]
        if whole_tensors and whole_shards:
            self._whole = WholeTensorStep(optimizer, whole_shards, self._groups, self._master_dtype)
            self._shard_of_optimizer_param.update(self._whole.shard_of_param())

        self._require_grad_sync = True
        self._in_backward = False
        self._unreduced = False
        self._grad_norm: float | torch.Tensor | None = None  # a tensor until read (`_step_with_device_norm`)
        self._last_overflow = False
        self._deferred = DeferredGathers()
        for shard in self._shards:
            # A parameter belongs to the newest optimizer built over it: an older one's hook is removed, so
            # re-wrapping a model (e.g. after loading a checkpoint) never leaves a stale optimizer reducing gradients.
            previous = getattr(shard.working, _HOOK_ATTRIBUTE, None)
            if previous is not None:
                previous.remove()
            handle = shard.working.register_post_accumulate_grad_hook(self._grad_hook(shard))
            setattr(shard.working, _HOOK_ATTRIBUTE, handle)

    def _spanning_group_index(self) -> int:
        """The group whose ranks include every other group's: norm and overflow reduce over it (then TP, PP)."""
        all_ranks = {r for g in self._groups for r in group_ranks(g)}
        spanning = [i for i, g in enumerate(self._groups) if set(group_ranks(g)) >= all_ranks]
        if not spanning:
            raise ValueError(
                "the process groups in pg_to_param_list must be nested: one of them (the dense data-parallel "
                f"group) must contain the ranks of all the others; got {[group_ranks(g) for g in self._groups]}"
            )
        return spanning[0]

    def _grad_hook(self, shard: ParamShard) -> Any:
        """The parameter's post-accumulate hook. It holds this optimizer weakly: a tensor hook lives in C++, where
        Python's garbage collector cannot see it, so a strong reference would keep the optimizer, its state and
        the model alive after the user dropped them."""
        owner = weakref.ref(self)

        def hook(_param: torch.Tensor) -> None:
            optimizer = owner()
            if optimizer is not None:
                optimizer._on_grad(shard)

        return hook

    def _on_grad(self, shard: ParamShard) -> None:
        if not self._in_backward:
            raise RuntimeError(
                "a parameter managed by LowLevelZeroOptimizer received a gradient outside optimizer.backward(): "
                "call optimizer.backward(loss) or optimizer.backward_by_grad(tensor, grad) instead of "
                "loss.backward(), so that gradients are reduced"
            )
        shard.used = True
        if self._require_grad_sync:
            # Stage 2 reduces during backward even without overlap_communication, so that the full-size
            # gradients are released bucket by bucket instead of piling up until the end of backward. Only the
            # spanning group launches early: the other groups' buckets go at the end of backward, after it, so
            # every rank issues collectives on different groups in one global order (NCCL needs that).
            eager = self.options.overlap_communication or self.options.stage is ZeroStage.TWO
            eager = eager and shard.group_index == self._spanning_index
            self._reducers[shard.group_index].mark_ready(shard, launch=eager)

    # ---- properties -------------------------------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (over master shards): change `lr` here or with a scheduler."""
        return self.optim.param_groups

    @property
    def loss_scale(self) -> float:
        return self.grad_scaler.scale

    @property
    def stage(self) -> int:
        return self.options.stage.value

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last `step()` was skipped because of an inf/nan gradient."""
        return self._last_overflow

    # ---- backward -------------------------------------------------------------------------------------------
    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, inputs: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Backward of `loss` (scaled for fp16) and, outside `no_sync`, the reduction of the gradients.

        `inputs` limits which leaves receive gradients (torch's `backward(inputs=...)`; a zero-bubble pipeline
        computes input gradients and weight gradients in separate passes)."""
        self.synchronize_working_params()
        if self._fp16:
            loss = loss.float() * self.grad_scaler.scale  # scale in fp32: an fp16 loss times 2**16 may overflow
        self._run_backward(loss, None, retain_graph, inputs)

    def backward_by_grad(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor,
        inputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> None:
        """Backward from an intermediate `tensor` with upstream `grad` (pipeline stages).

        `grad` is used as given: in a pipeline it comes from the next stage, whose `backward(loss)` already applied
        the fp16 loss scale (as in ColossalAI; scaling it again would scale these gradients twice)."""
        self.synchronize_working_params()
        self._run_backward(tensor, grad, retain_graph, inputs)

    def _run_backward(
        self,
        tensor: torch.Tensor,
        grad: torch.Tensor | None,
        retain_graph: bool,
        inputs: Sequence[torch.Tensor] | None,
    ) -> None:
        self._in_backward = True
        try:
            torch.autograd.backward(tensor, grad, retain_graph=retain_graph, inputs=inputs)
        finally:
            self._in_backward = False
        self._after_backward()

    def _after_backward(self) -> None:
        if not self._require_grad_sync:
            self._unreduced = True
            return
        # The spanning group first (it may have launched early), then the others in their given order.
        order = [self._spanning_index] + [i for i in range(len(self._reducers)) if i != self._spanning_index]
        for index in order:
            self._reducers[index].flush()
        self._unreduced = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backwards inside; the next one outside reduces."""
        previous = self._require_grad_sync
        self._require_grad_sync = False
        try:
            yield
        finally:
            self._require_grad_sync = previous

    # ---- step -----------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Agree on used parameters and overflow, unscale and clip, step the shards, rebuild working params."""
        if not self._require_grad_sync:
            raise RuntimeError("step() inside no_sync(): leave the no_sync() context and run one more backward first")
        if self._unreduced:
            raise RuntimeError(
                "the last backward ran inside no_sync(), so its gradients were never reduced: "
                "run the final micro-batch's backward outside no_sync() before step()"
            )
        self.synchronize_working_params()
        self._agree_on_used()
        grads, weights = self._grads_and_weights()
        # One reduction answers both questions: an inf/nan anywhere makes the norm non-finite. Without fp16 there is
        # no overflow to decide on the host: the norm stays on the device (`_device_norm`).
        on_device = None
        if not self._fp16:
            on_device = device_norm_or_inf(grads, self.options.clipping.norm_type, self._norm_groups, weights)
        if on_device is not None:
            self._step_with_device_norm(grads, on_device)
            return
        scaled_norm = norm_or_inf(grads, self.options.clipping.norm_type, self._norm_groups, weights)
        overflow = self._fp16 and not math.isfinite(scaled_norm)
        scale = self.grad_scaler.scale
        self.grad_scaler.update(overflow)
        self._last_overflow = overflow
        if overflow:
            if self.options.verbose:
                self._logger.info(f"gradient overflow: step skipped, loss scale now {self.grad_scaler.scale}", [0])
            self._clear_gradients()
            return
        norm = scaled_norm / scale
        self._grad_norm = norm
        factor = 1.0 / scale
        if self.options.clipping.enabled:
            factor *= clip_coefficient(norm, self.options.clipping.max_norm)
        if factor != 1.0 and grads:
            torch._foreach_mul_(grads, factor)
        self._step_shards()

    def _step_with_device_norm(self, grads: list[torch.Tensor], scaled_norm: torch.Tensor) -> None:
        """bf16/fp32: unscale and clip with the norm left on the device; `get_grad_norm` reads it when asked."""
        scale = self.grad_scaler.scale
        self.grad_scaler.update(False)
        self._last_overflow = False
        norm = scaled_norm / scale
        self._grad_norm = norm
        if self.options.clipping.enabled and grads:
            torch._foreach_mul_(grads, device_clip_coefficient(norm, self.options.clipping.max_norm) / scale)
        elif scale != 1.0 and grads:
            torch._foreach_mul_(grads, 1.0 / scale)
        self._step_shards()

    def _step_shards(self) -> None:
        for shard in self._on_shards:
            shard.master.grad = shard.grad_shard
        if self._whole is not None:
            self._whole.step(self.optim)  # one step of the wrapped optimizer: the whole masters and these shards
        else:
            if self._bf16_states is not None:
                self._bf16_states.step()
            else:
                self.optim.step()
        self._clear_gradients()
        pending = [p for gatherer in self._gatherers for p in gatherer.start(self.options.overlap_allgather)]
        if self.options.overlap_allgather:
            self._deferred.defer(pending)
        else:
            for item in pending:
                item.finish()

    # ---- clipping between backward and step (ColossalAI's OptimizerWrapper methods) ------------------------
    def _reduced_grads(self, what: str) -> list[torch.Tensor]:
        """This rank's reduced gradient shards (still multiplied by the loss scale), after the last backward."""
        if not self._require_grad_sync or self._unreduced:
            raise RuntimeError(
                f"{what}: the gradients are not reduced yet; call it after the last backward outside no_sync(), "
                "before step()"
            )
        self._agree_on_used()
        return [s.grad_shard for s in self._shards if s.grad_shard is not None]

    def clip_grad_by_norm(self, max_norm: float, norm_type: float | str = 2.0) -> float:
        """Scale the reduced gradients so that their global `norm_type` norm (over every shard on every rank, and
        the TP/PP groups) is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_` does on one process; the norm
        is taken on the unscaled (fp16 loss-scaled) gradients. Returns that norm (inf/nan: nothing is changed, and
        an fp16 `step()` skips). Call between the backward and `step()`."""
        if not max_norm > 0 or math.isinf(max_norm):
            raise ValueError(f"clip_grad_by_norm: max_norm must be a positive number, got {max_norm}")
        grads = self._reduced_grads("clip_grad_by_norm")
        weights = [self._norm_weight[id(s)] for s in self._shards if s.grad_shard is not None]
        norm = norm_or_inf(grads, NormType.parse(norm_type), self._norm_groups, weights) / self.grad_scaler.scale
        coefficient = clip_coefficient(norm, max_norm)
        if math.isfinite(norm) and coefficient < 1.0 and grads:
            torch._foreach_mul_(grads, coefficient)
        return norm

    def clip_grad_by_value(self, clip_value: float) -> None:
        """Clamp every unscaled gradient element into [-clip_value, clip_value] (`torch.nn.utils.clip_grad_value_`).
        In fp16 an inf/nan anywhere leaves the gradients as they are, so that `step()` still sees the overflow and
        skips (clamping would turn an inf into a finite value). Call between the backward and `step()`."""
        if not clip_value > 0 or math.isinf(clip_value):
            raise ValueError(f"clip_grad_by_value: clip_value must be a positive number, got {clip_value}")
        grads = self._reduced_grads("clip_grad_by_value")
        if self._fp16 and not math.isfinite(norm_or_inf(grads, self.options.clipping.norm_type, self._norm_groups)):
            return
        bound = clip_value * self.grad_scaler.scale
        for grad in grads:
            grad.clamp_(-bound, bound)

    def _grads_and_weights(self) -> tuple[list[torch.Tensor], list[float]]:
        held = [s for s in self._shards if s.grad_shard is not None]
        return [s.grad_shard for s in held if s.grad_shard is not None], [self._norm_weight[id(s)] for s in held]

    def _agree_on_used(self) -> None:
        """A parameter takes part in the step when any rank of its group produced a gradient for it (the flags
        travelled with the gradient buckets, so every rank of the group reads the same answer).

        When this rank used every parameter itself the answer is known without reading the flags (any rank's use
        counts), so the usual step reads nothing on the host; otherwise the flags are read once, in one transfer."""
        if all(s.used and s.used_anywhere is not None for s in self._shards):
            used = {id(s): True for s in self._shards}
        else:
            flagged = [s for s in self._shards if s.used_anywhere is not None]
            flags = torch.cat([s.used_anywhere for s in flagged if s.used_anywhere is not None]) if flagged else None
            values: list[bool] = [bool(v) for v in flags.tolist()] if flags is not None else []
            used = {id(s): values[i] for i, s in enumerate(flagged)}
        for shard in self._shards:
            if not used.get(id(shard), False):
                shard.grad_shard = None
            elif shard.grad_shard is None:
                shard.grad_shard = torch.zeros_like(shard.master)

    def _clear_gradients(self) -> None:
        for shard in self._shards:
            shard.grad_shard = None
            shard.master.grad = None
            shard.used = False
            shard.used_anywhere = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the working gradients and the reduced gradient shards."""
        for shard in self._shards:
            if set_to_none or shard.working.grad is None:
                shard.working.grad = None
            else:
                shard.working.grad.zero_()
        self._clear_gradients()
        self._unreduced = False

    def get_grad_norm(self) -> float | None:
        """The unscaled global norm (norm_type) of the gradients of the last completed step (None before any)."""
        if isinstance(self._grad_norm, torch.Tensor):
            self._grad_norm = float(self._grad_norm)  # the step left it on the device: read it now, once
        return self._grad_norm

    def synchronize_working_params(self) -> None:
        """Finish every deferred all-gather (`overlap_allgather`) so the working parameters are up to date."""
        self._deferred.finish_all()
