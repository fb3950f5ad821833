"""`--plugin` and the parallel flags turned into the plugin that trains: the flags become cx-plan's `Candidate`
(`plan_candidate`, the run as the planner judges it) and cx-plan's `make_plugin` builds the plugin from it, with the
switches the planner does not judge (fp8 and its recipe, sequence overlap, fused kernels, Gemini's shard fraction)
passed to the constructor as they are (`plugin_extras`), so `cx-train --plan` predicts exactly the configuration that
trains and `cx-plan --measure` runs it the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn

from cx_plan import Candidate, Optimizer
from cx_plan import make_plugin as plugin_for
from cx_plugins import Plugin

if TYPE_CHECKING:  # _options builds the candidate to check it, so it imports this module
    from cx_train.config._options import TrainOptions

__all__ = ["make_plugin", "plan_candidate", "plugin_extras"]

_HYBRID = ("hybrid", "moe_hybrid")


def _checkpoint_ratio(options: TrainOptions) -> float:
    ratio = options.switches.checkpoint_ratio
    return ratio if ratio is not None else 1.0 if options.activation_checkpointing else 0.0


def plan_candidate(options: TrainOptions, world_size: int) -> Candidate:
    """The planner's description of the run these options start on `world_size` ranks (cx-plan judges the same)."""
    hybrid = options.plugin in _HYBRID
    if options.pp > 1:  # the pipeline splits each rank's batch into --microbatches
        micro, count = options.batch_size // options.microbatches, options.microbatches * options.grad_accum
    else:
        micro, count = options.batch_size, options.grad_accum
    switches = options.switches
    return Candidate(
        options.plugin,
        dp=options.data_parallel_size(world_size),
        tp=options.tp,
        pp=options.pp,
        sp=options.sp,
        sp_mode=options.sp_mode,  # ColossalAI's sp_size is the all_to_all / ring_attn axis
        ep=options.ep,
        zero_stage=options.zero if hybrid else (options.zero or 2 if options.plugin == "low_level_zero" else None),
        micro_batch_size=max(1, micro),
        num_microbatches=count,
        pp_style=options.pp_style if options.pp > 1 else "1f1b",
        checkpoint_ratio=_checkpoint_ratio(options),  # hybrid: through ShardFormer, a ratio of the layers
        checkpoint_mode=options.checkpoint_mode if not hybrid else "full",
        placement_policy=switches.placement or "static",
        offload_optim_frac=switches.offload_optim_fraction or 0.0,
        offload_param_frac=switches.offload_param_fraction or 0.0,
        cpu_offload=switches.cpu_offload,
        fsdp_wrap=switches.fsdp_wrap if options.plugin == "torch_fsdp" else "model",  # by default each decoder layer
        precision=options.precision,
        optimizer_states_dtype=switches.optimizer_states_dtype,
        optimizer=Optimizer.MUON if options.optimizer == "muon" else Optimizer.ADAMW,  # the fused Adams hold AdamW's
    )


def plugin_extras(options: TrainOptions) -> dict[str, Any]:
    """The plugin constructor's arguments that the candidate does not carry, in ColossalAI's names (only those
    switched on, so a plugin without them is never handed one: `_plugin_flags` refused that before any start)."""
    s = options.switches
    extras: dict[str, Any] = {}
    for name, on in (
        ("use_fp8", s.fp8),
        ("fp8_communication", s.fp8_communication),
        ("enable_sequence_overlap", s.sequence_overlap),
        ("enable_jit_fused", s.jit_fused),
        ("enable_fused_normalization", s.fused_normalization),
    ):
        if on:
            extras[name] = True
    if s.fp8 and s.fp8_recipe is not None:  # every plugin with use_fp8 takes it; beside the Candidate, as use_fp8 is
        extras["fp8_recipe"] = s.fp8_recipe  # (the planner judges no fp8: neither changes its memory or time)
    if s.shard_fraction is not None:
        extras["shard_param_frac"] = s.shard_fraction
    if options.pp > 1 and options.pp_layers == "balanced":  # the planner splits evenly; balanced lowers the last stage
        extras["num_layers_per_stage"] = "balanced"
    return extras


def make_plugin(options: TrainOptions, model: nn.Module | None = None) -> tuple[Plugin, str | None]:
    """The plugin and the Booster's `mixed_precision` (for DDP, which leaves precision to the Booster), on this
    process group's world (or `--nproc` before one exists). torch_fsdp shards each decoder layer of `model` on its
    own, as torchtitan and every FSDP recipe do, so a step gathers a block at a time: it needs the model."""
    world = dist.get_world_size() if dist.is_initialized() else options.nproc
    # torch_fsdp without the model: a clear error there
    return plugin_for(plan_candidate(options, world), model, plugin_extras(options))
