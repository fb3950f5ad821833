"""ColossalAI's flat HybridParallelPlugin keywords -> `HybridParallelOptions`, validated once: what cx does not
build is refused here, before any group or model is touched, naming the argument."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cx_mesh.fp8 import ScalingRecipe
from cx_plugins.fp8._use_fp8 import check_fp8_recipe
from cx_plugins.hybrid._options import (
    HybridParallelOptions,
    PipelineOptions,
    ZeroOptions,
    check_custom_policy,
    parse_layers_per_stage,
    parse_pipeline_style,
)
from cx_plugins.options._ddp import DDPOptions
from cx_plugins.options._shardformer import ShardFormerOptions
from cx_shardformer import GradientCheckpointConfig, Policy
from cx_zero import LossScaleOptions, parse_states_dtype

__all__ = ["hybrid_options"]


def hybrid_options(
    name: str,
    *,
    tp_size: int,
    pp_size: int,
    sp_size: int | None,
    precision: str,
    zero_stage: int,
    enable_all_optimization: bool,
    enable_fused_normalization: bool,
    enable_flash_attention: bool,
    enable_jit_fused: bool,
    enable_sequence_parallelism: bool,
    sequence_parallelism_mode: str | None,
    enable_sequence_overlap: bool,
    parallel_output: bool,
    num_microbatches: int | None,
    microbatch_size: int | None,
    initial_scale: float,
    min_scale: float,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
    max_scale: float,
    max_norm: float,
    broadcast_buffers: bool,
    ddp_bucket_cap_mb: int,
    find_unused_parameters: bool,
    check_reduction: bool,
    gradient_as_bucket_view: bool,
    static_graph: bool,
    zero_bucket_size_in_m: int,
    cpu_offload: bool,
    communication_dtype: torch.dtype | None,
    overlap_communication: bool,
    custom_policy: Policy | None,
    pp_style: str,
    num_model_chunks: int,
    num_layers_per_stage: Sequence[int] | str | None,
    gradient_checkpoint_config: GradientCheckpointConfig | None,
    enable_metadata_cache: bool,
    make_vocab_size_divisible_by: int,
    dp_outside: bool,
    overlap_p2p: bool,
    overlap_allgather: bool,
    inner_ring_size: int | None,
    fp8_communication: bool,
    use_fp8: bool,
    optimizer_states_dtype: str | torch.dtype = "fp32",
    fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
) -> tuple[HybridParallelOptions, Policy | None]:
    """The plugin's typed option groups and its checked custom policy; `name` is the plugin the user built (errors
    name it)."""
    if inner_ring_size is not None:
        raise NotImplementedError(
            f"{name}(inner_ring_size={inner_ring_size}): double-ring attention is not supported by cx; leave "
            "inner_ring_size=None (ring_attn runs one ring over the sp group)"
        )
    custom_policy = check_custom_policy(custom_policy, name)
    layers_per_stage, balance_layers = parse_layers_per_stage(num_layers_per_stage, name)
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
        use_fp8=use_fp8,
        fp8_communication=fp8_communication,
        fp8_recipe=check_fp8_recipe(name, use_fp8, fp8_recipe),
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
            fp8_communication=fp8_communication,
            optimizer_states_dtype=parse_states_dtype(optimizer_states_dtype, name),
        ),
        pipeline=PipelineOptions(
            style=parse_pipeline_style(pp_style, name),
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            num_model_chunks=num_model_chunks,
            num_layers_per_stage=layers_per_stage,
            balance_layers=balance_layers,
            enable_metadata_cache=enable_metadata_cache,
            overlap_p2p=overlap_p2p,
            fp8_communication=fp8_communication,
        ),
        plugin=name,
    )
    _refuse_unsupported(options, name)
    return options, custom_policy


def _refuse_unsupported(options: HybridParallelOptions, plugin: str) -> None:
    """Combinations cx has not built or tested, refused before anything is set up."""
    if options.zero.cpu_offload and options.zero.stage == 0:
        raise ValueError(f"{plugin}: cpu_offload offloads ZeRO's optimizer state: it needs zero_stage 1 or 2")
    if options.zero.optimizer_states_dtype != torch.float32 and options.zero.stage == 0:
        raise ValueError(
            f"{plugin}: optimizer_states_dtype='bf16' is ZeRO's (cx_zero.Bf16StateAdam): it needs zero_stage 1 or 2"
        )
