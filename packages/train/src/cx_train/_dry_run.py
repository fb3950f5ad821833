"""`cx-train --dry-run` / `--plan`: what a run would be, without starting it.

Prints the resolved config (TOML, as `--config` reads it), which rank holds which parallel coordinates, and cx-plan's
prediction for this configuration. With `--data`, the data line the real start prints (windows, chats packed whole or
text cut, documents truncated / dropped, evaluation windows), from the token cache the option checks built. The
layout is computed from the sizes, in the plugins' own axis order (the `ParallelLayout` tables: hybrid (dp, pp, tp,
sp), MoE hybrid (moe_dp, pp, ep, tp, sp), Gemini (dp, tp), the ZeRO / DDP / FSDP plugins one data axis), ranks
row-major over it as `ProcessGroupMesh` numbers them; no process group is made. The memory per rank (parameters,
gradients, optimizer states, master weights, activations from a FakeTensor trace of the real model under the real
policy, pipeline in-flight micro-batches, communication buffers, the peak) and the step time are the planner's
(`cx_plan`), on this machine's device: one memory model for cx-plan and cx-train.
"""

from __future__ import annotations

import itertools

from cx_plan import (
    TEXT_VOCAB_SIZE,
    ModelShape,
    detect_device,
    format_bytes,
    load_model_shape,
    memory_model,
    memory_per_rank,
    predict_step_time,
)
from cx_plugins import FILL, Axis, resolve_sizes
from cx_train.config._config_file import resolved_toml
from cx_train.config._options import TrainOptions
from cx_train.data._user_data import open_user_data
from cx_train.models._plugins import plan_candidate
from cx_train.models._spec import describe_model

__all__ = ["dense_dp", "dry_run_report", "layout_rows", "plan_lines"]


def _axes(options: TrainOptions) -> list[tuple[Axis, int]]:
    if options.plugin == "hybrid":
        return [(Axis.DP, FILL), (Axis.PP, options.pp), (Axis.TP, options.tp), (Axis.SP, options.sp)]
    if options.plugin == "moe_hybrid":
        ep = [(Axis.EP, options.ep)]
        return [(Axis.MOE_DP, FILL), (Axis.PP, options.pp), *ep, (Axis.TP, options.tp), (Axis.SP, options.sp)]
    if options.plugin == "gemini" and options.tp > 1:  # GeminiPlugin's (zero, extra_dp, tp): tp innermost
        return [(Axis.DP, FILL), (Axis.TP, options.tp)]
    return [(Axis.DP, FILL)]


def dense_dp(coordinates: dict[Axis, int], sizes: dict[Axis, int]) -> int:
    """The data-parallel rank of the dense parameters under moe_hybrid: (moe_dp, ep) taken together, row-major, as
    `ParallelLayout.rank(Axis.MOE_DP, Axis.EP)` numbers it (the plugin's `dp_size` is moe_dp x ep)."""
    return coordinates[Axis.MOE_DP] * sizes[Axis.EP] + coordinates[Axis.EP]


def layout_rows(options: TrainOptions, world_size: int) -> list[str]:
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


def plan_lines(options: TrainOptions, world: int, shape: ModelShape | None = None) -> list[str]:
    """cx-plan's prediction of this run on this machine's device (`cx_plan`): parameters, memory per rank
    by component with the fit against the device, and the step time."""
    if shape is None:
        spec = options.model_spec  # a folder or config.json sizes itself; a built-in model takes the run's encoding
        vocab = TEXT_VOCAB_SIZE if spec.is_folder else describe_model(spec).tokenizer.vocab_size  # --data: bytes
        shape = load_model_shape(
            options.model,
            hidden_size=options.hidden_size,
            num_layers=options.num_layers,
            seq_len=options.seq_len,
            vocab_size=vocab,
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
        f"# predicted step on {world} x {device.name} (cx-plan, {device.efficiency:.0%} of peak): "
        f"{step.step_s * 1e3:.2f} ms, {step.tokens_per_s:,.0f} tokens/s, MFU {step.mfu:.1%}",
        f"#   compute {step.compute_s * 1e3:.2f} ms (recompute {step.recompute_s * 1e3:.2f}), pipeline bubble "
        f"{step.bubble_s * 1e3:.2f} ms, optimizer {step.optimizer_s * 1e3:.2f} ms; communication: {comm}",
    ]


def dry_run_report(options: TrainOptions, world_size: int | None = None) -> str:
    world = options.nproc if world_size is None else world_size
    lines = ["# cx-train --dry-run: nothing is trained", resolved_toml(dict(options.resolved)).rstrip()]
    lines.append(f"# parallel layout: {options.plugin} on {world} ranks (mesh order, outermost first)")
    lines += [f"#   {row}" for row in layout_rows(options, world)]
    if options.data is not None:  # what the real start prints (_train.py), as a comment
        data = open_user_data(options.data, options.model, options.model_spec.is_folder, options.window_length)
        lines.append(f"# {data.summary()}")
    lines += plan_lines(options, world)
    return "\n".join(lines) + "\n"
