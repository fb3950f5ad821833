"""`HybridParallelPlugin`: tensor, sequence, pipeline and data parallelism (torch-DDP-like or ZeRO-1/2), composed.

The constructor turns ColossalAI's flat arguments into `HybridParallelOptions` once, builds the (dp, pp, tp, sp)
`ParallelLayout` (sizes checked before any collective) and the pipeline schedule; `configure` composes ShardFormer,
the pipeline split, the cast and the optimizer (`_hybrid_model.py`, `_hybrid_optimizer.py`). Nothing here computes a
rank: the layout owns every group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import CheckpointIO
from cx_mesh import ProcessGroup, assert_same_across_ranks, get_accelerator
from cx_pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
)
from cx_plugins._ddp_options import DDPOptions
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins._plugin import Boosted, ZeroPluginBase
from cx_plugins._shardformer_options import ShardFormerOptions
from cx_plugins._weak_lookup import WeakLookup
from cx_plugins._wrappers import ModelWrapper, OptimizerWrapper
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView
from cx_plugins.hybrid._batch_check import BatchCheck
from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from cx_plugins.hybrid._init_agreement import agree_initial_states
from cx_plugins.hybrid._model import ComposedModel, HybridParallelModule, broadcast_states, compose_model
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer, HybridZeroOptimizer
from cx_plugins.hybrid._options import (
    HybridParallelOptions,
    PipelineOptions,
    PipelineStyle,
    SequenceParallelism,
    ZeroOptions,
    check_custom_policy,
    parse_pipeline_style,
)
from cx_plugins.lazy._context import LazyModel, is_lazy
from cx_shardformer import GradientCheckpointConfig, Policy, ShardConfig, get_shard_spec
from cx_zero import ClipOptions, LossScaleOptions, LowLevelZeroOptimizer, LowLevelZeroOptions, ZeroStage

__all__ = ["HybridParallelPlugin"]


class HybridParallelPlugin(ZeroPluginBase):
    """ColossalAI's HybridParallelPlugin: every argument honoured or refused with a clear error (docs/plugins.md)."""

    def __init__(
        self,
        tp_size: int,
        pp_size: int,
        sp_size: int | None = None,
        precision: str = "fp16",
        zero_stage: int = 0,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_parallelism: bool = False,
        sequence_parallelism_mode: str | None = None,
        enable_sequence_overlap: bool = False,
        parallel_output: bool = True,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0,
        broadcast_buffers: bool = True,
        ddp_bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        zero_bucket_size_in_m: int = 12,
        cpu_offload: bool = False,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        custom_policy: Policy | None = None,
        pp_style: str = "1f1b",
        num_model_chunks: int = 1,
        num_layers_per_stage: Sequence[int] | None = None,
        gradient_checkpoint_config: GradientCheckpointConfig | None = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        dp_outside: bool = True,
        overlap_p2p: bool = True,
        overlap_allgather: bool = False,
        inner_ring_size: int | None = None,
        fp8_communication: bool = False,
        use_fp8: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__  # errors name the plugin the user built (MoeHybridParallelPlugin extends this one)
        if fp8_communication or use_fp8:
            which = "fp8_communication" if fp8_communication else "use_fp8"
            raise NotImplementedError(f"{name}({which}=True): fp8 is not supported by cx yet")
        if inner_ring_size is not None:
            raise NotImplementedError(
                f"{name}(inner_ring_size={inner_ring_size}): double-ring attention is not supported by cx; leave "
                "inner_ring_size=None (ring_attn runs one ring over the sp group)"
            )
        custom_policy = check_custom_policy(custom_policy, name)
        shardformer = ShardFormerOptions(
            enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_jit_fused=enable_jit_fused,
            enable_sequence_parallelism=enable_sequence_parallelism,
            sequence_parallelism_mode=None,  # set from the validated mode below
            enable_sequence_overlap=enable_sequence_overlap,
            parallel_output=parallel_output,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            gradient_checkpoint_config=gradient_checkpoint_config,
        )
        options = HybridParallelOptions.build(
            tp_size=tp_size,
            pp_size=pp_size,
            sp_size=sp_size,
            precision=precision,
            zero_stage=zero_stage,
            sequence_parallelism_mode=sequence_parallelism_mode,
            enable_sequence_parallelism=enable_sequence_parallelism,
            max_norm=max_norm,
            dp_outside=dp_outside,
            shardformer=shardformer,
            loss_scale=LossScaleOptions(
                initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale
            ),
            ddp=DDPOptions(
                broadcast_buffers,
                ddp_bucket_cap_mb,
                find_unused_parameters,
                check_reduction,
                gradient_as_bucket_view,
                static_graph,
            ),
            zero=ZeroOptions(
                bucket_size_in_m=zero_bucket_size_in_m,
                cpu_offload=cpu_offload,
                communication_dtype=communication_dtype,
                overlap_communication=overlap_communication,
                overlap_allgather=overlap_allgather,
            ),
            pipeline=PipelineOptions(
                style=parse_pipeline_style(pp_style, name),
                num_microbatches=num_microbatches,
                microbatch_size=microbatch_size,
                num_model_chunks=num_model_chunks,
                num_layers_per_stage=None if num_layers_per_stage is None else tuple(num_layers_per_stage),
                enable_metadata_cache=enable_metadata_cache,
                overlap_p2p=overlap_p2p,
            ),
            plugin=name,
        )
        _refuse_unsupported(options, name)
        self.options = options
        self.custom_policy = custom_policy
        assert_same_across_ranks(
            (options, type(custom_policy).__name__ if custom_policy else None), what=f"{name} options"
        )
        self.layout = self._build_layout(options)
        idle = options.idle_arguments()
        if idle:
            reasons = "; ".join(f"{name}: {why}" for name, why in idle.items())
            warnings.warn(f"{type(self).__name__}: these arguments change nothing here ({reasons})", stacklevel=2)
        self.shard_config = self._shard_config()  # built (and validated by ShardConfig) before any model is seen
        self.stage_manager: PipelineStageManager | None = None
        self.schedule: PipelineSchedule | None = None
        if pp_size > 1:
            self.stage_manager, self.schedule = _pipeline(self.layout, options.pipeline)
        # what checkpoint IO needs: each boosted optimizer's model and by-name face, each model's own dtype
        self._module_of: WeakLookup[Optimizer, HybridParallelModule] = WeakLookup()
        self._wrapper_of: WeakLookup[Optimizer, _HybridOptimizer] = WeakLookup()
        self._dtype_of: weakref.WeakKeyDictionary[nn.Module, torch.dtype] = weakref.WeakKeyDictionary()

    def _build_layout(self, options: HybridParallelOptions) -> ParallelLayout:
        """(dp, pp, tp, sp), or (pp, dp, tp, sp) without dp_outside; subclasses add axes (MoE: moe_dp and ep)."""
        pp, dp = (Axis.PP, options.pp_size), (Axis.DP, FILL)
        outer = [dp, pp] if options.dp_outside else [pp, dp]
        return ParallelLayout.build([*outer, (Axis.TP, options.tp_size), (Axis.SP, options.sp_size)], (Axis.DP,))

    # ---- sizes and groups -----------------------------------------------------------------------------------------
    @property
    def tp_size(self) -> int:
        return self.layout.size(Axis.TP)

    @property
    def pp_size(self) -> int:
        return self.layout.size(Axis.PP)

    @property
    def dp_size(self) -> int:
        return self.layout.size(Axis.DP)

    @property
    def sp_size(self) -> int:
        return self.layout.size(Axis.SP)

    @property
    def enable_pipeline_parallelism(self) -> bool:
        return self.pp_size > 1

    # ColossalAI's group attributes (its examples read e.g. plugin.dp_group); the layout owns them
    @property
    def dp_group(self) -> ProcessGroup:
        return self.layout.group(Axis.DP)

    @property
    def tp_group(self) -> ProcessGroup:
        return self.layout.group(Axis.TP)

    @property
    def pp_group(self) -> ProcessGroup:
        return self.layout.group(Axis.PP)

    @property
    def sp_group(self) -> ProcessGroup:
        """The group the sequence is split over: the tp group for split_gather / ring, else the sp axis."""
        return self.layout.group(Axis.SP) if self.options.sp_mode.on_sp_axis else self.layout.group(Axis.TP)

    def _gradient_group(self) -> ProcessGroup | None:
        """The group gradients are averaged over: dp, or dp x sp under Ulysses (as ColossalAI; equal results)."""
        if self.options.sp_mode.on_sp_axis:
            return self.layout.group_or_none(Axis.DP, Axis.SP)
        return self.layout.group_or_none(Axis.DP)

    def _shard_config(self) -> ShardConfig | None:
        o = self.options
        needed = o.tp_size > 1 or o.sp_mode is not SequenceParallelism.NONE or self.custom_policy is not None
        needed = needed or bool(o.shardformer.switched_on()) or o.shardformer.gradient_checkpoint_config is not None
        if not needed:
            return None
        tp_group = self.layout.group(Axis.TP)
        sp_group = self.layout.group(Axis.SP) if o.sp_mode.on_sp_axis else tp_group
        switches = o.shardformer
        if o.sp_mode is not SequenceParallelism.NONE:
            switches = dataclasses.replace(switches, sequence_parallelism_mode=o.sp_mode.shardformer_mode)
        return switches.shard_config(tp_group, sp_group, enable_tensor_parallelism=o.tp_size > 1)

    # ---- Booster interface ----------------------------------------------------------------------------------------
    def support_no_sync(self) -> bool:
        return True

    def supports_pipeline(self) -> bool:
        return self.pp_size > 1

    def materialises_lazy_models(self) -> bool:
        """A lazily built model is sharded on the meta device and materialised parameter by parameter, each cut at
        once to this rank's tensor-parallel slice (other pipeline stages' parameters are never made)."""
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        if isinstance(model, ModelWrapper):
            raise ValueError(f"{type(self).__name__}.configure: the model is already boosted")
        o = self.options
        original_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        before = {id(p): name for name, p in model.named_parameters()}  # to follow parameters ShardFormer replaces
        lazy = LazyModel(model) if is_lazy(model) else None
        # before slicing: the model each rank of a replica cuts its slice from must be the same one (rank 0's)
        replica = [a for a in self.layout.axes if a not in (Axis.DP, Axis.MOE_DP)]
        agree_initial_states(model, lazy, self.layout.group_or_none(*replica), type(self).__name__)
        composed = compose_model(
            model,
            self.shard_config,
            self.custom_policy,
            self.stage_manager,
            o.precision.dtype,
            get_accelerator().current_device(),
            lazy,
            plugin=type(self).__name__,
        )
        if optimizer is not None:
            _repoint_replaced(optimizer, before, composed.module)
            _require_model_parameters(optimizer, composed.names, type(self).__name__)
        grad_group = self._gradient_group()
        self._broadcast_states(composed, grad_group)
        held_names = frozenset(composed.names[id(p)] for p in composed.held)
        boosted = HybridParallelModule(
            composed.module,
            self.layout,
            composed.pipeline,
            held_names,
            compute_dtype=o.precision.dtype,
            batch_check=self._batch_check(),
        )
        wrapped: OptimizerWrapper | None = None
        if optimizer is not None:
            if o.zero.stage == 0:
                wrapped = HybridParallelOptimizer(
                    optimizer,
                    held=composed.held,
                    names=composed.names,
                    dtype=o.precision.dtype,
                    loss_scale=o.loss_scale,
                    max_norm=o.max_norm,
                    dp_group=grad_group,
                    norm_groups=self._unsharded_norm_groups(),
                    norm_weights=self._unsharded_norm_weights(boosted, composed.held),
                    bucket_cap_mb=o.ddp.bucket_cap_mb,
                    reduce_groups=self._reduce_groups(composed.held),
                )
            else:
                wrapped = self._zero_optimizer(optimizer, boosted, composed.held, grad_group)
            self._module_of[optimizer] = boosted
            self._wrapper_of[optimizer] = wrapped
        if original_dtype is not None:
            self._dtype_of[boosted] = original_dtype
        return boosted, wrapped, criterion, dataloader, lr_scheduler

    def _batch_check(self) -> BatchCheck | None:
        """The check that the ranks sharing a batch (every axis but the data axes: pp, tp, sp) are given the same
        one; None when one rank holds a whole replica."""
        axes = [a for a in self.layout.axes if a not in self.layout.data_axes and self.layout.size(a) > 1]
        if not axes:
            return None
        names = " x ".join(a.value for a in axes)
        return BatchCheck(self.layout.group(*axes), self.layout.ranks(*axes), names, type(self).__name__)

    # ---- hooks a subclass (MoeHybridParallelPlugin) overrides -------------------------------------------------
    def _broadcast_states(self, composed: ComposedModel, grad_group: ProcessGroup | None) -> None:
        """Start every data-parallel replica from the first one's parameters (and buffers)."""
        broadcast_states(composed.module, composed.held, grad_group, buffers=self.options.ddp.broadcast_buffers)

    def _reduce_groups(self, held: list[nn.Parameter]) -> dict[int, ProcessGroup | None] | None:
        """zero_stage 0: parameters (by id) averaged over another group than the data-parallel one (None: none)."""
        return None

    def _zero_param_groups(self, optimizer: Optimizer) -> dict[ProcessGroup, list[nn.Parameter]] | None:
        """zero_stage 1/2: cx_zero's pg_to_param_list (None: every parameter over the data-parallel group)."""
        return None

    def _unsharded_norm_groups(self) -> list[ProcessGroup | None]:
        """zero_stage 0: the groups a rank's (dp-averaged) norm term is summed over."""
        return [self.layout.group_or_none(Axis.TP), self.layout.group_or_none(Axis.PP)]

    def _unsharded_norm_weights(self, model: HybridParallelModule, held: list[nn.Parameter]) -> dict[int, float]:
        """zero_stage 0: each parameter's weight in the norm term summed over `_unsharded_norm_groups`."""
        return self._norm_weights(model, held)

    def _zero_norm_weights(self, model: HybridParallelModule, held: list[nn.Parameter]) -> dict[int, float]:
        """zero_stage 1/2: each parameter's weight in the norm ZeRO sums over its spanning group, tp and pp."""
        return self._norm_weights(model, held)

    def _norm_weights(self, model: HybridParallelModule, held: list[nn.Parameter]) -> dict[int, float]:
        """Each element of the model counted once in the global norm: 1/tp for a tp-replicated parameter, 1/k for a
        parameter tied over k pipeline stages."""
        tp = self.tp_size
        weights = {id(p): 1.0 if get_shard_spec(p) is not None else 1.0 / tp for p in held}
        if model.pipeline is not None:
            for shared in model.pipeline.shared:
                if shared.group is not None and id(shared.param) in weights:
                    weights[id(shared.param)] /= len(shared.stages)
        return weights

    def _zero_optimizer(
        self,
        optimizer: Optimizer,
        model: HybridParallelModule,
        held: list[nn.Parameter],
        grad_group: ProcessGroup | None,
    ) -> HybridZeroOptimizer:
        o = self.options
        held_ids = {id(p) for p in held}
        for group in optimizer.param_groups:  # other stages' parameters are not this rank's to train
            group["params"] = [p for p in group["params"] if id(p) in held_ids]
        by_group = self._zero_param_groups(optimizer)
        zero = LowLevelZeroOptimizer(
            optimizer,
            dp_process_group=None if by_group is not None else grad_group or self.dp_group,  # None: the world
            pg_to_param_list=by_group,
            options=LowLevelZeroOptions(
                loss_scale=o.loss_scale,
                clipping=ClipOptions(max_norm=o.max_norm),
                reduce_bucket_size=int(o.zero.bucket_size_in_m * 1024 * 1024),
                communication_dtype=o.zero.communication_dtype,
                overlap_communication=o.zero.overlap_communication,
                stage=ZeroStage.TWO if o.zero.stage == 2 else ZeroStage.ONE,
                cpu_offload=o.zero.cpu_offload,
                overlap_allgather=o.zero.overlap_allgather,
            ),
            module=model.unwrap(),
            tp_process_group=self.layout.group_or_none(Axis.TP),
            pp_process_group=self.layout.group_or_none(Axis.PP),
            grad_norm_weights=self._zero_norm_weights(model, held),
        )
        return HybridZeroOptimizer(optimizer, zero)

    def execute_pipeline(
        self,
        data_iter: Iterator[Any],
        model: nn.Module,
        criterion: Callable[[Any, Any], torch.Tensor] | None,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One step of the pipeline schedule over the next batch of `data_iter` (forwards and backwards of every
        micro-batch; the loss is returned on the rank holding the last stage). The optimizer step is the caller's."""
        if self.schedule is None or not isinstance(model, HybridParallelModule) or model.pipeline is None:
            raise ValueError(
                "execute_pipeline needs pp_size > 1 and the model booster.boost returned; with pp_size=1 call "
                "model(**batch) and booster.backward(loss, optimizer)"
            )
        if optimizer is not None and not isinstance(optimizer, HybridParallelOptimizer | HybridZeroOptimizer):
            raise TypeError("execute_pipeline needs the optimizer booster.boost returned (or None)")
        batches = map(model.prepare_inputs, data_iter)  # cast and checked as model(...) does, when the schedule
        # takes its batch (the same point of every rank's step: the replica group's check is collective)
        return self.schedule.forward_backward_step(
            model.pipeline, batches, criterion, optimizer, return_loss=return_loss, return_outputs=return_outputs
        )

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without communication. zero_stage 0 reduces only at the step anyway."""
        if isinstance(optimizer, HybridZeroOptimizer):
            return optimizer.no_sync()
        return contextlib.nullcontext()

    def get_checkpoint_io(self) -> CheckpointIO:
        """The canonical cx format: TP shards and pipeline stages gathered by `HybridCheckpointIO`, floating tensors
        saved in the model's own dtype; a model load refreshes the fp32 master weights of its optimizers."""
        return HybridCheckpointIO(self._parts_of, after_model_load=self._refresh_masters, model_dtype=self._saved_dtype)

    def _refresh_masters(self, view: ParallelModelView) -> None:
        for optimizer, module in self._module_of.items():
            wrapped = self._wrapper_of.get(optimizer)
            if module is view and wrapped is not None:
                wrapped.update_master_params(module)

    def _parts_of(self, optimizer: Optimizer) -> tuple[HybridParallelModule, _HybridOptimizer] | None:
        """The boosted model and optimizer wrapper built around `optimizer`, while the user holds them."""
        module, wrapped = self._module_of.get(optimizer), self._wrapper_of.get(optimizer)
        return None if module is None or wrapped is None else (module, wrapped)

    def _saved_dtype(self, view: ParallelModelView) -> torch.dtype | None:
        return self._dtype_of.get(cast(nn.Module, view))


_HybridOptimizer = HybridParallelOptimizer | HybridZeroOptimizer


def _repoint_replaced(optimizer: Optimizer, before: dict[int, str], module: nn.Module) -> None:
    """Point the optimizer at the parameters that replaced its own under the same name (e.g. ShardFormer's MoE
    policies put this rank's expert slice in place of the full stack), so one built before boost keeps working."""
    now = dict(module.named_parameters(remove_duplicate=False))
    live = {id(p) for p in now.values()}
    for group in optimizer.param_groups:
        group["params"] = [
            now[before[id(p)]] if id(p) not in live and before.get(id(p)) in now else p for p in group["params"]
        ]


def _require_model_parameters(optimizer: Optimizer, names: dict[int, str], plugin: str) -> None:
    """Every parameter the optimizer trains must be the model's (other stages' ones are dropped, so a stranger
    would be dropped silently too)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [i for i, p in enumerate(params) if id(p) not in names]
    if strangers:
        raise ValueError(
            f"{plugin}: the optimizer holds parameters (positions {strangers[:10]}) that are not the "
            "model's; build it from model.parameters() before booster.boost"
        )


def _refuse_unsupported(options: HybridParallelOptions, plugin: str) -> None:
    """Combinations cx has not built or tested, refused before anything is set up."""
    if options.zero.cpu_offload and options.zero.stage == 0:
        raise ValueError(f"{plugin}: cpu_offload offloads ZeRO's optimizer state: it needs zero_stage 1 or 2")


def _pipeline(layout: ParallelLayout, o: PipelineOptions) -> tuple[PipelineStageManager, PipelineSchedule]:
    manager = PipelineStageManager(
        layout.mesh,
        Axis.PP.value,
        enable_interleave=o.style is not PipelineStyle.ONE_F_ONE_B,
        use_zbv=o.style is PipelineStyle.ZBV,
        num_model_chunks=o.num_model_chunks,
        num_layers_per_stage=None if o.num_layers_per_stage is None else list(o.num_layers_per_stage),
    )
    schedule: PipelineSchedule
    if o.style is PipelineStyle.ONE_F_ONE_B:
        schedule = OneForwardOneBackwardSchedule(
            manager, o.num_microbatches, o.microbatch_size, o.enable_metadata_cache, o.overlap_p2p
        )
    elif o.style is PipelineStyle.INTERLEAVED:
        schedule = InterleavedSchedule(
            manager, o.num_model_chunks, o.num_microbatches, o.microbatch_size, o.enable_metadata_cache, o.overlap_p2p
        )
    else:
        schedule = ZeroBubbleVPipeScheduler(
            manager, o.num_model_chunks, o.num_microbatches, o.microbatch_size, o.enable_metadata_cache, o.overlap_p2p
        )
    return manager, schedule
