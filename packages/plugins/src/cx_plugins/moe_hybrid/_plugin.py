"""`MoeHybridParallelPlugin`: HybridParallelPlugin with the experts of MoE blocks split over an expert-parallel axis.

The mesh is (moe_dp, pp, ep, tp, sp), or (pp, moe_dp, ep, tp, sp) with `moe_dp_outside=False`. The data-parallel
dimension is moe_dp x ep (every rank of it sees its own batch): dense parameters are averaged over it as in
HybridParallelPlugin, while each expert slice lives on one ep rank of it and is averaged over moe_dp only (cx-moe's
dispatch already summed it over the ep group's batches, scaled by 1/ep). Everything else (ShardFormer, the casts, the
fp32-master optimizer, ZeRO-1/2) is the base plugin's, steered through its small hooks: which group reduces which
parameter, how the gradient norm counts an expert slice, how replicas start equal.

Pipeline parallelism: every stage's router logits travel to the last stage with the hidden states (cx-pipeline's
transformers splitter), so the aux loss pools all layers of a micro-batch as transformers' does. Sequence
parallelism: each rank routes the tokens of its sequence shard; router and expert gradients are summed over the
sequence-parallel group and the router logits gathered over it for the aux loss (cx-shardformer's MoE policies);
with all_to_all / ring_attn (the sp axis) dense gradients are averaged over moe_dp x ep x sp; with a pipeline as well,
the stages pass sequence shards on and the gathered router logits travel to the last stage. enable_sequence_overlap
rings split_gather's collectives with the matmuls (cx-shardformer).

fp8: `use_fp8` and `fp8_communication` go to the base plugin (dense layers, TP / ZeRO / pipeline collectives) and to
cx-moe (`convert_moe_to_fp8` after ShardFormer): every MoE block's expert matmuls run in fp8, and with ep > 1 the
dispatch / combine all-to-alls carry fp8 rows (E4M3 forward, E5M2 gradients). At ep 1 there is no all-to-all, so
fp8_communication compresses only the base plugin's collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.optim import Optimizer

from cx_mesh import ProcessGroup, assert_same_across_ranks
from cx_mesh.fp8 import Fp8Options, ScalingRecipe
from cx_moe import HF_MOE_BLOCKS, MoeFp8Options, MoeLayer, convert_moe_to_fp8, is_moe_tensor
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins.fp8._use_fp8 import check_fp8_recipe
from cx_plugins.hybrid._model import ComposedModel, HybridParallelModule, broadcast_states
from cx_plugins.hybrid._optimizer_kind import refuse_non_elementwise
from cx_plugins.hybrid._options import HybridParallelOptions
from cx_plugins.hybrid._plugin import HybridParallelPlugin
from cx_shardformer import GradientCheckpointConfig, Policy, ShardConfig
from cx_zero import needs_whole_tensors

__all__ = ["MoeHybridParallelPlugin"]

_NAME = "MoeHybridParallelPlugin"


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """ColossalAI's MoeHybridParallelPlugin (training): experts over ep, dense parameters data-parallel over
    moe_dp x ep, expert slices over moe_dp; zero_stage 0, 1 and 2 (no silent downgrade of ZeRO-2). docs/plugins.md."""

    def __init__(
        self,
        tp_size: int,
        pp_size: int,
        ep_size: int,
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
        overlap_communication: bool = False,
        custom_policy: Policy | None = None,
        pp_style: str = "1f1b",
        num_model_chunks: int = 1,
        num_layers_per_stage: Sequence[int] | str | None = None,
        gradient_checkpoint_config: GradientCheckpointConfig | None = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        moe_dp_outside: bool = True,
        overlap_p2p: bool = True,
        overlap_allgather: bool = False,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        *,  # cx's additions, by keyword only: ColossalAI's positional order stays as it is
        optimizer_states_dtype: str | torch.dtype = "fp32",
        fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    ) -> None:
        if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
            raise ValueError(f"{_NAME}: ep_size must be a positive integer, got {ep_size!r}")
        assert_same_across_ranks((ep_size, moe_dp_outside), what=f"{_NAME} ep_size and moe_dp_outside")
        self._ep_size = ep_size
        # the MoE half of the fp8 switches (the base plugin takes both for everything else)
        self._moe_fp8 = MoeFp8Options(
            use_fp8=use_fp8,
            fp8_communication=fp8_communication and ep_size > 1,
            matmul=Fp8Options(recipe=check_fp8_recipe(_NAME, use_fp8, fp8_recipe)),
        )
        if enable_sequence_parallelism and sequence_parallelism_mode is None:
            sequence_parallelism_mode = "all_to_all"  # ColossalAI's MoE default (its dense plugin's: split_gather)
        super().__init__(
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
            dp_outside=moe_dp_outside,
            overlap_p2p=overlap_p2p,
            overlap_allgather=overlap_allgather,
            fp8_communication=fp8_communication,
            use_fp8=use_fp8,
            optimizer_states_dtype=optimizer_states_dtype,
            fp8_recipe=fp8_recipe,
        )

    # ---- layout ---------------------------------------------------------------------------------------------------
    def support_lora(self) -> bool:
        """Not yet: adapters on expert slices (split over ep and moe_dp) are neither sharded nor gathered."""
        return False

    def _build_layout(self, options: HybridParallelOptions) -> ParallelLayout:
        """(moe_dp, pp, ep, tp, sp) or (pp, moe_dp, ep, tp, sp); the data axes are moe_dp and ep."""
        pp, moe_dp = (Axis.PP, options.pp_size), (Axis.MOE_DP, FILL)
        outer = [moe_dp, pp] if options.dp_outside else [pp, moe_dp]
        axes = [*outer, (Axis.EP, self._ep_size), (Axis.TP, options.tp_size), (Axis.SP, options.sp_size)]
        return ParallelLayout.build(axes, data_axes=(Axis.MOE_DP, Axis.EP))

    @property
    def ep_size(self) -> int:
        return self.layout.size(Axis.EP)

    @property
    def moe_dp_size(self) -> int:
        return self.layout.size(Axis.MOE_DP)

    @property
    def dp_size(self) -> int:
        """The data-parallel size of dense parameters: moe_dp x ep."""
        return self.layout.size(Axis.MOE_DP, Axis.EP)

    @property
    def dp_group(self) -> ProcessGroup:
        """The group dense gradients are averaged over: moe_dp x ep."""
        return self.layout.group(Axis.MOE_DP, Axis.EP)

    @property
    def ep_group(self) -> ProcessGroup:
        return self.layout.group(Axis.EP)

    @property
    def moe_dp_group(self) -> ProcessGroup:
        """The group an expert slice's gradient is averaged over (the ranks holding the same experts)."""
        return self.layout.group(Axis.MOE_DP)

    def _dense_axes(self) -> tuple[Axis, ...]:
        """The axes dense gradients are averaged over: moe_dp x ep, x sp under all_to_all / ring_attn (there every
        sp rank already holds the full-sequence gradient, so the average over sp changes nothing, as ColossalAI)."""
        if self.options.sp_mode.on_sp_axis:
            return (Axis.MOE_DP, Axis.EP, Axis.SP)
        return (Axis.MOE_DP, Axis.EP)

    def _expert_axes(self) -> tuple[Axis, ...]:
        """The axes an expert slice is replicated over: moe_dp (averaged), and sp on the sp axis (equal there)."""
        return (Axis.MOE_DP, Axis.SP) if self.options.sp_mode.on_sp_axis else (Axis.MOE_DP,)

    def _gradient_group(self) -> ProcessGroup | None:
        return self.layout.group_or_none(*self._dense_axes())

    def _shard_config(self) -> ShardConfig | None:
        """The base plugin's ShardConfig (tensor and sequence parallelism) plus the ep and moe_dp groups (the MoE
        policies split experts over ep)."""
        config = super()._shard_config()
        if self._ep_size == 1:
            return config
        if config is None:
            tp_group = self.layout.group(Axis.TP)
            config = self.options.shardformer.shard_config(
                tp_group, tp_group, enable_tensor_parallelism=self.options.tp_size > 1
            )
        return dataclasses.replace(
            config, ep_group=self.layout.group(Axis.EP), moe_dp_group=self.layout.group(Axis.MOE_DP)
        )

    # ---- the base plugin's hooks --------------------------------------------------------------------------------
    def _compose_model(
        self, model: nn.Module, optimizer: Optimizer | None
    ) -> tuple[ComposedModel, HybridParallelModule]:
        """The base plugin's composition, then fp8 for the MoE blocks (after ShardFormer made them expert-parallel;
        their parameters and names are unchanged, so the optimizer and checkpoints see the same model)."""
        composed, boosted = super()._compose_model(model, optimizer)
        module = composed.module
        has_moe = any(isinstance(m, MoeLayer) or type(m).__name__ in HF_MOE_BLOCKS for m in module.modules())
        if self._moe_fp8.enabled and has_moe:
            convert_moe_to_fp8(module, self._moe_fp8)
        return composed, boosted

    def _check_optimizer_kind(self, optimizer: Optimizer, composed: ComposedModel) -> None:
        """Elementwise optimizers always. A whole-tensor one (Muon, MuonWithAdamW): at tp_size 1 each ep rank holds
        whole experts (stacks split along the expert dimension) and whole dense matrices, so zero_stage 0 steps them
        as they are and ZeRO-1/2 steps each whole on an owner rank of its group (cx_zero's `_whole_step`). At tp > 1
        every tp-split tensor is gathered whole to an owner in the tp group: the dense slices, and the expert stacks
        an `expert_tensor_parallel` policy splits along each expert's intermediate dimension (the owner gets whole
        experts); by default experts are replicated over tp and stepped whole by every tp rank. zero_stage 0 does
        it directly (`_tp_whole`), ZeRO-1/2 after ZeRO gathered each slice whole onto its owner in the slice's group,
        dp or moe_dp (`_tp_zero_whole`), per pp stage (each stage's tp group gathers its own slices), under every
        sequence-parallel mode (they change only which ranks form ZeRO's groups) and with cpu_offload (the masters
        stay on the CPU, the tp collectives run on the communication device)."""
        if needs_whole_tensors(optimizer):
            return
        why = (
            "tp_size > 1 hands it slices of the dense matrices (and of the experts under expert_tensor_parallel)"
            if self.options.tp_size > 1
            else "expert parallelism and ZeRO may hand it slices (expert stacks split along the expert dimension)"
        )
        refuse_non_elementwise(optimizer, type(self).__name__, why)

    def _broadcast_states(self, composed: ComposedModel, grad_group: ProcessGroup | None) -> None:
        """Dense parameters and buffers start from the first dp replica, each expert slice from the first rank of
        its moe_dp group (the ep ranks hold different experts)."""
        experts = [p for p in composed.held if is_moe_tensor(p)]
        dense = [p for p in composed.held if not is_moe_tensor(p)]
        broadcast_states(composed.module, dense, grad_group, buffers=self.options.ddp.broadcast_buffers)
        broadcast_states(composed.module, experts, self.layout.group_or_none(*self._expert_axes()), buffers=False)

    def _reduce_groups(self, held: list[nn.Parameter]) -> dict[int, ProcessGroup | None] | None:
        moe_dp = self.layout.group_or_none(Axis.MOE_DP)
        return {id(p): moe_dp for p in held if is_moe_tensor(p)}

    def _zero_param_groups(self, optimizer: Optimizer) -> dict[ProcessGroup, list[nn.Parameter]] | None:
        """{dp group: dense parameters, moe_dp group: expert slices}; either list may be empty (frozen experts,
        adapters only)."""
        if self._ep_size == 1:
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {
            self.layout.group(*self._dense_axes()): [p for p in params if not is_moe_tensor(p)],
            self.moe_dp_group: [p for p in params if is_moe_tensor(p)],
        }

    def _zero_norm_weights(self, model: HybridParallelModule, held: list[nn.Parameter]) -> dict[int, float]:
        """ZeRO sums the norm over the dense group; under all_to_all / ring_attn that spans sp, over which expert
        slices (partitioned over moe_dp only) are replicated: weight 1/sp so each counts once."""
        weights = super()._zero_norm_weights(model, held)
        sp = self.layout.size(Axis.SP)
        if self._ep_size == 1 or sp == 1 or not self.options.sp_mode.on_sp_axis:
            return weights
        experts = {id(p) for p in held if is_moe_tensor(p)}
        return {key: value / sp if key in experts else value for key, value in weights.items()}

    def _unsharded_norm_groups(self) -> list[ProcessGroup | None]:
        """zero_stage 0: the norm term is also summed over ep, where the expert slices differ."""
        return [*super()._unsharded_norm_groups(), self.layout.group_or_none(Axis.EP)]

    def _unsharded_norm_weights(self, model: HybridParallelModule, held: list[nn.Parameter]) -> dict[int, float]:
        """Dense gradients are equal over ep after the dp average: weight 1/ep so the sum over ep counts them once."""
        weights = super()._unsharded_norm_weights(model, held)
        ep = self._ep_size
        return {id(p): weights[id(p)] if is_moe_tensor(p) else weights[id(p)] / ep for p in held}
