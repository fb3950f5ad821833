"""`HybridParallelPlugin`: tensor, sequence, pipeline and data parallelism (torch-DDP-like or ZeRO-1/2), composed.

The class reads as the composition: the constructor validates ColossalAI's flat arguments into
`HybridParallelOptions` (`_arguments.py`) and builds the layout (the (dp, pp, tp, sp) `ParallelLayout`, sizes checked
before any collective; the ShardFormer config; the pipeline schedule); `configure` composes the model (replica
agreement, ShardFormer, the pipeline split, the cast: `_model.py`) and then the optimizer (`_optimizer.py`,
`_compose.py`). Nothing here computes a rank: the layout owns every group (`_groups.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import CheckpointIO
from cx_mesh import ProcessGroup, assert_same_across_ranks, get_accelerator
from cx_mesh.fp8 import ScalingRecipe
from cx_pipeline import PipelineSchedule, PipelineStageManager
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins._plugin import Boosted, ZeroPluginBase
from cx_plugins.fp8._communication import warn_if_nothing_to_compress
from cx_plugins.fp8._use_fp8 import convert_linears_to_fp8
from cx_plugins.hybrid._arguments import hybrid_options
from cx_plugins.hybrid._batch_check import BatchCheck
from cx_plugins.hybrid._boosted import BoostedParts, HybridOptimizer
from cx_plugins.hybrid._compose import (
    build_pipeline,
    keep_held,
    norm_weights,
    repoint_replaced,
    require_model_parameters,
    zero_optimizer,
)
from cx_plugins.hybrid._groups import LayoutAttributes
from cx_plugins.hybrid._init_agreement import agree_initial_states
from cx_plugins.hybrid._model import ComposedModel, HybridParallelModule, broadcast_states, compose_model
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer, HybridZeroOptimizer
from cx_plugins.hybrid._optimizer_kind import refuse_whole_tensor_on_slices
from cx_plugins.hybrid._options import HybridParallelOptions, SequenceParallelism
from cx_plugins.hybrid._tp_zero_whole import ZeroTensorParallelWhole
from cx_plugins.lazy._context import LazyModel, is_lazy
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_shardformer import GradientCheckpointConfig, Policy, ShardConfig
from cx_zero import needs_whole_tensors

__all__ = ["HybridParallelPlugin"]


class HybridParallelPlugin(LayoutAttributes, ZeroPluginBase):
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
        num_layers_per_stage: Sequence[int] | str | None = None,
        gradient_checkpoint_config: GradientCheckpointConfig | None = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        dp_outside: bool = True,
        overlap_p2p: bool = True,
        overlap_allgather: bool = False,
        inner_ring_size: int | None = None,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        *,  # cx's additions, by keyword only: ColossalAI's positional order stays as it is
        optimizer_states_dtype: str | torch.dtype = "fp32",
        fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    ) -> None:
        super().__init__()
        name = type(self).__name__  # errors name the plugin the user built (MoeHybridParallelPlugin extends this one)
        # validate: the flat keywords as typed option groups, refused combinations named, the same on every rank
        options, custom_policy = hybrid_options(
            name,
            tp_size=tp_size,
            pp_size=pp_size,
            sp_size=sp_size,
            precision=precision,
            zero_stage=zero_stage,
            enable_all_optimization=enable_all_optimization,
            enable_fused_normalization=enable_fused_normalization,
            enable_flash_attention=enable_flash_attention,
            enable_jit_fused=enable_jit_fused,
            enable_sequence_parallelism=enable_sequence_parallelism,
            sequence_parallelism_mode=sequence_parallelism_mode,
            enable_sequence_overlap=enable_sequence_overlap,
            parallel_output=parallel_output,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            initial_scale=initial_scale,
            min_scale=min_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            hysteresis=hysteresis,
            max_scale=max_scale,
            max_norm=max_norm,
            broadcast_buffers=broadcast_buffers,
            ddp_bucket_cap_mb=ddp_bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
            zero_bucket_size_in_m=zero_bucket_size_in_m,
            cpu_offload=cpu_offload,
            communication_dtype=communication_dtype,
            overlap_communication=overlap_communication,
            custom_policy=custom_policy,
            pp_style=pp_style,
            num_model_chunks=num_model_chunks,
            num_layers_per_stage=num_layers_per_stage,
            gradient_checkpoint_config=gradient_checkpoint_config,
            enable_metadata_cache=enable_metadata_cache,
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            dp_outside=dp_outside,
            overlap_p2p=overlap_p2p,
            overlap_allgather=overlap_allgather,
            inner_ring_size=inner_ring_size,
            fp8_communication=fp8_communication,
            use_fp8=use_fp8,
            optimizer_states_dtype=optimizer_states_dtype,
            fp8_recipe=fp8_recipe,
        )
        self.options = options
        self.custom_policy = custom_policy
        assert_same_across_ranks(
            (options, type(custom_policy).__name__ if custom_policy else None), what=f"{name} options"
        )
        # layout: every group and rank, the ShardFormer config over it, the pipeline schedule
        self.layout = self._build_layout(options)
        warn_if_nothing_to_compress(name, options.pipeline.fp8_communication, self.layout.world_size)
        idle = options.idle_arguments()
        if idle:
            reasons = "; ".join(f"{name}: {why}" for name, why in idle.items())
            warnings.warn(f"{type(self).__name__}: these arguments change nothing here ({reasons})", stacklevel=2)
        self.shard_config = self._shard_config()  # built (and validated by ShardConfig) before any model is seen
        self.stage_manager: PipelineStageManager | None = None
        self.schedule: PipelineSchedule | None = None
        if pp_size > 1:
            self.stage_manager, self.schedule = build_pipeline(self.layout, options.pipeline)
        self._boosted = BoostedParts()  # what the checkpoint IO needs of each boost

    def _build_layout(self, options: HybridParallelOptions) -> ParallelLayout:
        """(dp, pp, tp, sp), or (pp, dp, tp, sp) without dp_outside; subclasses add axes (MoE: moe_dp and ep)."""
        pp, dp = (Axis.PP, options.pp_size), (Axis.DP, FILL)
        outer = [dp, pp] if options.dp_outside else [pp, dp]
        return ParallelLayout.build([*outer, (Axis.TP, options.tp_size), (Axis.SP, options.sp_size)], (Axis.DP,))

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

    def support_lora(self) -> bool:
        """LoRA at every tp / pp / zero layout: ShardFormer shards the adapters of a peft LoRA layer with its base
        (column base: lora_B's rows split; row base: lora_A's columns split), and the adapter save gathers them."""
        return True

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
        composed, boosted = self._compose_model(model, optimizer)
        wrapped = None if optimizer is None else self._compose_optimizer(optimizer, composed, boosted)
        return boosted, wrapped, criterion, dataloader, lr_scheduler

    def _compose_model(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[ComposedModel, HybridParallelModule]:
        """Agree on the initial model over the replica, shard it (ShardFormer, pipeline split, cast), start the
        data-parallel replicas from the first one, and wrap it; an optimizer built before boost is pointed at the
        parameters that replaced its own."""
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
        if o.shardformer.use_fp8:  # the plain nn.Linear layers ShardFormer left (the TP layers' fp8 is ShardConfig's)
            convert_linears_to_fp8(composed.module, type(self).__name__, o.shardformer.fp8_options())
        if optimizer is not None:
            repoint_replaced(optimizer, before, composed.module)
            require_model_parameters(optimizer, composed.names, type(self).__name__)
        self._broadcast_states(composed, self._gradient_group())
        held_names = frozenset(composed.names[id(p)] for p in composed.held)
        boosted = HybridParallelModule(
            composed.module,
            self.layout,
            composed.pipeline,
            held_names,
            compute_dtype=o.precision.dtype,
            batch_check=self._batch_check(),
        )
        if original_dtype is not None:
            self._boosted.remember_dtype(boosted, original_dtype)
        return composed, boosted

    def _compose_optimizer(
        self,
        optimizer: Optimizer,
        composed: ComposedModel,
        boosted: HybridParallelModule,
    ) -> HybridOptimizer:
        """zero_stage 0: gradients reduced at the step over the gradient group; 1/2: cx-zero's LowLevelZeroOptimizer
        (with a whole-tensor optimizer at tp > 1, the tp step of `_tp_zero_whole` inside its step). Remembered for
        the checkpoint IO."""
        o = self.options
        self._check_optimizer_kind(optimizer, composed)
        grad_group = self._gradient_group()
        wrapped: HybridOptimizer
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
                fp8_communication=o.zero.fp8_communication,
                whole_tensors_over=self._whole_tensor_group(optimizer),
            )
        else:
            wrapped = self._zero_optimizer(optimizer, boosted, composed.held, grad_group)
        self._boosted.remember(optimizer, boosted, wrapped)
        return wrapped

    def _batch_check(self) -> BatchCheck | None:
        """The check that the ranks sharing a batch (every axis but the data axes: pp, tp, sp) are given the same
        one; None when one rank holds a whole replica."""
        axes = [a for a in self.layout.axes if a not in self.layout.data_axes and self.layout.size(a) > 1]
        if not axes:
            return None
        names = " x ".join(a.value for a in axes)
        return BatchCheck(self.layout.group(*axes), self.layout.ranks(*axes), names, type(self).__name__)

    # ---- hooks a subclass (MoeHybridParallelPlugin) overrides -------------------------------------------------
    def _check_optimizer_kind(self, optimizer: Optimizer, composed: ComposedModel) -> None:
        """Refuse an optimizer that is not elementwise over tensor-parallel slices (`_optimizer_kind`), except a
        whole-tensor one (Muon), which steps whole matrices on tp owner ranks: at zero_stage 0 (`_tp_whole`), and at
        zero_stage 1/2 after ZeRO gathered each slice whole onto its dp owner (`_tp_zero_whole`; with cpu_offload
        the masters stay on the CPU, the tp collectives run on the communication device)."""
        if needs_whole_tensors(optimizer):
            return
        refuse_whole_tensor_on_slices(optimizer, composed.names, type(self).__name__)

    def _whole_tensor_group(self, optimizer: Optimizer) -> ProcessGroup | None:
        """The tp group a whole-tensor optimizer gathers its split matrices over (None: nothing to gather)."""
        tp = self.layout.group_or_none(Axis.TP)
        return tp if tp is not None and self.tp_size > 1 and needs_whole_tensors(optimizer) else None

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
        return norm_weights(model, held, self.tp_size)

    def _zero_norm_weights(self, model: HybridParallelModule, held: list[nn.Parameter]) -> dict[int, float]:
        """zero_stage 1/2: each parameter's weight in the norm ZeRO sums over its spanning group, tp and pp."""
        return norm_weights(model, held, self.tp_size)

    def _zero_optimizer(
        self,
        optimizer: Optimizer,
        model: HybridParallelModule,
        held: list[nn.Parameter],
        grad_group: ProcessGroup | None,
    ) -> HybridZeroOptimizer:
        keep_held(optimizer, held)  # other stages' parameters are not this rank's to train
        by_group = self._zero_param_groups(optimizer)
        zero = zero_optimizer(
            optimizer,
            self.options,
            model.unwrap(),
            dp_group=None if by_group is not None else grad_group or self.dp_group,  # None: the world
            by_group=by_group,
            tp_group=self.layout.group_or_none(Axis.TP),
            pp_group=self.layout.group_or_none(Axis.PP),
            norm_weights=self._zero_norm_weights(model, held),
        )
        tp_group = self._whole_tensor_group(optimizer)
        tp_whole = None
        if tp_group is not None:  # a whole-tensor optimizer over tp slices: the tp step after ZeRO's gather
            names = {id(p): name for name, p in model.unwrap().named_parameters()}
            tp_whole = ZeroTensorParallelWhole(optimizer, zero, names, tp_group, type(self).__name__)
        return HybridZeroOptimizer(optimizer, zero, tp_whole)

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
        return self._boosted.checkpoint_io()
