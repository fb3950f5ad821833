"""`cx-train --dry-run` / `--plan`: what a run would be, without starting it.

Prints the resolved config (TOML, as `--config` reads it), which rank holds which parallel coordinates, and cx-plan's
prediction for this configuration. The layout is computed from the sizes, in the plugins' own axis order (the
`ParallelLayout` tables: hybrid (dp, pp, tp, sp), MoE hybrid (moe_dp, pp, ep, tp, sp), the ZeRO / DDP / FSDP plugins
one data axis), ranks row-major over it as `ProcessGroupMesh` numbers them; no process group is made. The memory per
rank (parameters, gradients, optimizer states, master weights, activations from a FakeTensor trace of the real model
under the real policy, pipeline in-flight micro-batches, communication buffers, the peak) and the step time are the
planner's (`cx_plugins.plan`), on this machine's device: one memory model for cx-plan and cx-train.
"""

from __future__ import annotations

import itertools

from cx_plugins._layout import FILL, Axis, resolve_sizes
from cx_plugins.demo._config_file import resolved_toml
from cx_plugins.demo._options import DemoOptions
from cx_plugins.plan import Candidate, ModelShape, load_model_shape
from cx_plugins.plan._devices import detect_device, memory_per_rank
from cx_plugins.plan._fits import format_bytes
from cx_plugins.plan._memory_model import memory_model
from cx_plugins.plan._step_time import ACHIEVABLE_FRACTION, predict_step_time

__all__ = ["dense_dp", "dry_run_report", "layout_rows", "plan_candidate", "plan_lines"]


def _axes(options: DemoOptions) -> list[tuple[Axis, int]]:
    if options.plugin == "hybrid":
        return [(Axis.DP, FILL), (Axis.PP, options.pp), (Axis.TP, options.tp), (Axis.SP, options.sp)]
    if options.plugin == "moe_hybrid":
        ep = [(Axis.EP, options.ep)]
        return [(Axis.MOE_DP, FILL), (Axis.PP, options.pp), *ep, (Axis.TP, options.tp), (Axis.SP, options.sp)]
    return [(Axis.DP, FILL)]


def dense_dp(coordinates: dict[Axis, int], sizes: dict[Axis, int]) -> int:
    """The data-parallel rank of the dense parameters under moe_hybrid: (moe_dp, ep) taken together, row-major, as
    `ParallelLayout.rank(Axis.MOE_DP, Axis.EP)` numbers it (the plugin's `dp_size` is moe_dp x ep)."""
    return coordinates[Axis.MOE_DP] * sizes[Axis.EP] + coordinates[Axis.EP]


def layout_rows(options: DemoOptions, world_size: int) -> list[str]:
    """One line per rank: `rank 3: dp=1 pp=0 tp=1 sp=0` (mesh order, outermost first); under moe_hybrid the dense
    data-parallel rank `dp` follows `moe_dp` (ranks of one moe_dp group but another ep coordinate see other data)."""
    axes = _axes(options)
    sizes = resolve_sizes(axes, world_size)
    by_axis = dict(zip((axis for axis, _ in axes), sizes, strict=True))
    rows = []
    for rank, coordinates in enumerate(itertools.product(*(range(s) for s in sizes))):
        at = dict(zip((axis for axis, _ in axes), coordinates, strict=True))
        fields = []
        for axis, coordinate in at.items():
            fields.append(f"{axis.value}={coordinate}")
            if axis is Axis.MOE_DP:
                fields.append(f"dp={dense_dp(at, by_axis)}")
        rows.append(f"rank {rank}: " + " ".join(fields))
    return rows


def plan_candidate(options: DemoOptions, world_size: int) -> Candidate:
    """The planner's description of the run these options start on `world_size` ranks (cx-plan judges the same)."""
    hybrid = options.plugin in ("hybrid", "moe_hybrid")
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
        sp_mode="all_to_all" if options.sp > 1 else None,
        ep=options.ep,
        zero_stage=options.zero if hybrid else (2 if options.plugin == "low_level_zero" else None),
        micro_batch_size=max(1, micro),
        num_microbatches=count,
        pp_style=options.pp_style if options.pp > 1 else "1f1b",
        checkpoint_ratio=1.0 if options.activation_checkpointing else 0.0,
        checkpoint_mode=options.checkpoint_mode if options.plugin not in ("hybrid", "moe_hybrid") else "full",
        fsdp_wrap="block" if options.plugin == "torch_fsdp" else "model",  # cx-train shards each decoder layer
        precision=options.precision,
    )


def plan_lines(options: DemoOptions, world: int, shape: ModelShape | None = None) -> list[str]:
    """cx-plan's prediction of this run on this machine's device (`cx_plugins.plan`): parameters, memory per rank
    by component with the fit against the device, and the step time."""
    if shape is None:
        shape = load_model_shape(
            options.model, hidden_size=options.hidden_size, num_layers=options.num_layers, seq_len=options.seq_len
        )
    device = detect_device()
    candidate = plan_candidate(options, world)
    counts = shape.parameters
    experts = f" ({counts.experts:,} in routed experts, split over ep {options.ep})" if counts.experts else ""
    per_rank = memory_per_rank(device, world)  # on the CPU the ranks share the host's memory
    verdict = memory_model(shape, options.seq_len, per_rank, host_is_device=device.name == "cpu")(candidate)
    parts = ", ".join(f"{n.replace('_', ' ')} {format_bytes(b)}" for n, b in verdict.prediction.components().items())
    fit = "fits" if verdict.fits else f"does not fit: {verdict.reason}"
    step = predict_step_time(candidate, shape, options.seq_len, device)
    comm = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in step.communication_s.items()) or "none"
    stage = f", busiest pipeline stage {verdict.prediction.stage}" if options.pp > 1 else ""
    host = format_bytes(device.memory_bytes)
    shared = f" a rank: {host} shared by {world}" if per_rank != device.memory_bytes else ""
    return [
        f"# parameters: {counts.total:,} in the model{experts}",
        f"# memory per rank (cx-plan, {options.precision}{stage}): {parts}; peak {format_bytes(verdict.peak_bytes)}",
        f"#   on {device.name} ({format_bytes(per_rank)}{shared}, {format_bytes(verdict.limit)} usable): {fit}",
        f"# predicted step on {world} x {device.name} (cx-plan, {ACHIEVABLE_FRACTION:.0%} of peak): "
        f"{step.step_s * 1e3:.2f} ms, {step.tokens_per_s:,.0f} tokens/s, MFU {step.mfu:.1%}",
        f"#   compute {step.compute_s * 1e3:.2f} ms (recompute {step.recompute_s * 1e3:.2f}), pipeline bubble "
        f"{step.bubble_s * 1e3:.2f} ms, optimizer {step.optimizer_s * 1e3:.2f} ms; communication: {comm}",
    ]


def dry_run_report(options: DemoOptions, world_size: int | None = None) -> str:
    world = options.nproc if world_size is None else world_size
    lines = ["# cx-train --dry-run: nothing is trained", resolved_toml(dict(options.resolved)).rstrip()]
    lines.append(f"# parallel layout: {options.plugin} on {world} ranks (mesh order, outermost first)")
    lines += [f"#   {row}" for row in layout_rows(options, world)]
    lines += plan_lines(options, world)
    return "\n".join(lines) + "\n"
