"""`--plugin` and the parallel flags turned into the plugin that trains: the flags become cx-plan's `Candidate`
(`plan_candidate`, the run as the planner judges it) and cx-plan's `make_plugin` builds the plugin from it, so
`cx-train --plan` predicts exactly the configuration that trains and `cx-plan --measure` runs it the same way.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from cx_plan import Candidate
from cx_plan import make_plugin as plugin_for
from cx_plugins import Plugin
from cx_train.config._options import TrainOptions

__all__ = ["make_plugin", "plan_candidate"]

_HYBRID = ("hybrid", "moe_hybrid")


def plan_candidate(options: TrainOptions, world_size: int) -> Candidate:
    """The planner's description of the run these options start on `world_size` ranks (cx-plan judges the same)."""
    hybrid = options.plugin in _HYBRID
    if options.pp > 1:  # the pipeline splits each rank's batch into --microbatches
        micro, count = options.batch_size // options.microbatches, options.microbatches * options.grad_accum
    else:
        micro, count = options.batch_size, options.grad_accum
    return Candidate(
        options.plugin,
        dp=options.data_parallel_size(world_size),
        tp=options.tp,
        pp=options.pp,
        sp=options.sp,
        sp_mode="all_to_all" if options.sp > 1 else None,  # ColossalAI's sp_size is the all_to_all (Ulysses) axis
        ep=options.ep,
        zero_stage=options.zero if hybrid else (options.zero or 2 if options.plugin == "low_level_zero" else None),
        micro_batch_size=max(1, micro),
        num_microbatches=count,
        pp_style=options.pp_style if options.pp > 1 else "1f1b",
        checkpoint_ratio=1.0 if options.activation_checkpointing else 0.0,  # hybrid: every layer through ShardFormer
        checkpoint_mode=options.checkpoint_mode if not hybrid else "full",
        fsdp_wrap="block" if options.plugin == "torch_fsdp" else "model",  # cx-train shards each decoder layer
        precision=options.precision,
    )


def make_plugin(options: TrainOptions, model: nn.Module | None = None) -> tuple[Plugin, str | None]:
    """The plugin and the Booster's `mixed_precision` (for DDP, which leaves precision to the Booster), on this
    process group's world (or `--nproc` before one exists). torch_fsdp shards each decoder layer of `model` on its
    own, as torchtitan and every FSDP recipe do, so a step gathers a block at a time: it needs the model."""
    world = dist.get_world_size() if dist.is_initialized() else options.nproc
    return plugin_for(plan_candidate(options, world), model)  # torch_fsdp without the model: a clear error there
