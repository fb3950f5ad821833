"""The pieces `HybridParallelPlugin.configure` composes besides the model itself: the pipeline schedule, the
optimizer's parameters checked against the sharded model, the weights of the global norm, and cx-zero's ZeRO
optimizer from the plugin's options."""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from cx_mesh import ProcessGroup
from cx_pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineSchedule,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
)
from cx_plugins._layout import Axis, ParallelLayout
from cx_plugins.hybrid._model import HybridParallelModule
from cx_plugins.hybrid._options import HybridParallelOptions, PipelineOptions, PipelineStyle
from cx_shardformer import get_shard_spec
from cx_zero import ClipOptions, LowLevelZeroOptimizer, LowLevelZeroOptions, ZeroStage

__all__ = [
    "build_pipeline",
    "keep_held",
    "norm_weights",
    "repoint_replaced",
    "require_model_parameters",
    "zero_optimizer",
]


def build_pipeline(layout: ParallelLayout, o: PipelineOptions) -> tuple[PipelineStageManager, PipelineSchedule]:
    manager = PipelineStageManager(
        layout.mesh,
        Axis.PP.value,
        enable_interleave=o.style is not PipelineStyle.ONE_F_ONE_B,
        use_zbv=o.style is PipelineStyle.ZBV,
        num_model_chunks=o.num_model_chunks,
        num_layers_per_stage=None if o.num_layers_per_stage is None else list(o.num_layers_per_stage),
        balance_layers=o.balance_layers,
    )
    schedule: PipelineSchedule
    common = (o.microbatch_size, o.enable_metadata_cache, o.overlap_p2p, o.fp8_communication)
    if o.style is PipelineStyle.ONE_F_ONE_B:
        schedule = OneForwardOneBackwardSchedule(manager, o.num_microbatches, *common)
    elif o.style is PipelineStyle.INTERLEAVED:
        schedule = InterleavedSchedule(manager, o.num_model_chunks, o.num_microbatches, *common)
    else:
        schedule = ZeroBubbleVPipeScheduler(manager, o.num_model_chunks, o.num_microbatches, *common)
    return manager, schedule


def repoint_replaced(optimizer: Optimizer, before: dict[int, str], module: nn.Module) -> None:
    """Point the optimizer at the parameters that replaced its own under the same name (e.g. ShardFormer's MoE
    policies put this rank's expert slice in place of the full stack), so one built before boost keeps working."""
    now = dict(module.named_parameters(remove_duplicate=False))
    live = {id(p) for p in now.values()}
    for group in optimizer.param_groups:
        group["params"] = [
            now[before[id(p)]] if id(p) not in live and before.get(id(p)) in now else p for p in group["params"]
        ]


def require_model_parameters(optimizer: Optimizer, names: dict[int, str], plugin: str) -> None:
    """Every parameter the optimizer trains must be the model's (other stages' ones are dropped, so a stranger
    would be dropped silently too)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    strangers = [i for i, p in enumerate(params) if id(p) not in names]
    if strangers:
        raise ValueError(
            f"{plugin}: the optimizer holds parameters (positions {strangers[:10]}) that are not the "
            "model's; build it from model.parameters() before booster.boost"
        )


def keep_held(optimizer: Optimizer, held: list[nn.Parameter]) -> None:
    """Drop from the optimizer the parameters this rank's pipeline stage does not hold."""
    held_ids = {id(p) for p in held}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in held_ids]


def zero_optimizer(
    optimizer: Optimizer,
    o: HybridParallelOptions,
    module: nn.Module,
    *,
    dp_group: ProcessGroup | None,
    by_group: dict[ProcessGroup, list[nn.Parameter]] | None,
    tp_group: ProcessGroup | None,
    pp_group: ProcessGroup | None,
    norm_weights: dict[int, float],
) -> LowLevelZeroOptimizer:
    """cx-zero's ZeRO-1/2 optimizer over `optimizer` with the plugin's loss scaling, clipping and ZeRO options."""
    return LowLevelZeroOptimizer(
        optimizer,
        dp_process_group=dp_group,
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
            fp8_communication=o.zero.fp8_communication,
            optimizer_states_dtype=o.zero.optimizer_states_dtype,
        ),
        module=module,
        tp_process_group=tp_group,
        pp_process_group=pp_group,
        grad_norm_weights=norm_weights,
    )


def norm_weights(model: HybridParallelModule, held: list[nn.Parameter], tp: int) -> dict[int, float]:
    """Each element of the model counted once in the global norm: 1/tp for a tp-replicated parameter, 1/k for a
    parameter tied over k pipeline stages."""
    weights = {id(p): 1.0 if get_shard_spec(p) is not None else 1.0 / tp for p in held}
    if model.pipeline is not None:
        for shared in model.pipeline.shared:
            if shared.group is not None and id(shared.param) in weights:
                weights[id(shared.param)] /= len(shared.stages)
    return weights
