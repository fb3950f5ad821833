"""`cx-train --dry-run`: what a run would be, without starting it.

Prints the resolved config (TOML, as `--config` reads it), which rank holds which parallel coordinates, and the
parameter and memory figures per rank. The layout is computed from the sizes, in the plugins' own axis order (the
`ParallelLayout` tables: hybrid (dp, pp, tp, sp), MoE hybrid (moe_dp, pp, ep, tp, sp), the ZeRO / DDP / FSDP plugins
one data axis), ranks row-major over it as `ProcessGroupMesh` numbers them; no process group is made. The model is
built on the meta device (no memory) to count its parameters. The memory figures are an estimate: the weights,
gradients and AdamW state each rank holds by the plugin's sharding, the layers split evenly over tp x pp (routed
experts also over ep); activations
and communication buffers are not included.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from cx_plugins._layout import FILL, Axis, resolve_sizes
from cx_plugins.demo._config_file import resolved_toml
from cx_plugins.demo._models import build_model, describe_model
from cx_plugins.demo._options import DemoOptions
from cx_plugins.plan import Candidate, load_model_shape
from cx_plugins.plan._devices import detect_device
from cx_plugins.plan._step_time import ACHIEVABLE_FRACTION, predict_step_time

__all__ = ["MemoryFigures", "dense_dp", "dry_run_report", "layout_rows", "memory_figures", "plan_candidate"]


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


@dataclass(frozen=True)
class MemoryFigures:
    parameters: int  # the whole model's
    parameters_per_rank: int  # held by one rank before any data-parallel sharding (tp x pp split)
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # AdamW's two fp32 moments, plus the fp32 master weights of 16-bit plugins

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.gradient_bytes + self.optimizer_bytes


def memory_figures(options: DemoOptions, parameters: int, world_size: int, experts: int = 0) -> MemoryFigures:
    """Bytes one rank holds for the weights, gradients and optimizer state, by the plugin's sharding; `experts` of
    the `parameters` are routed experts' (split over --ep as well)."""
    dp = options.data_parallel_size(world_size)
    per_rank = -(-(parameters - experts + experts // options.ep) // (options.tp * options.pp))
    half = options.precision != "fp32"
    own_precision = options.plugin in ("gemini", "low_level_zero", "hybrid", "moe_hybrid")  # 16-bit weights + master
    weight = 2 if half and own_precision else 4
    zero = {"gemini": 3, "low_level_zero": 2, "torch_fsdp": 3, "torch_ddp": 0}.get(options.plugin, options.zero)
    weights_split = dp if zero >= 3 else 1
    grads_split = dp if zero >= 2 else 1
    state_split = dp if zero >= 1 else 1
    master = 4 if half and own_precision else 0
    return MemoryFigures(
        parameters=parameters,
        parameters_per_rank=per_rank,
        weight_bytes=per_rank * weight // weights_split,
        gradient_bytes=per_rank * weight // grads_split,
        optimizer_bytes=per_rank * (8 + master) // state_split,
    )


def _count_parameters(options: DemoOptions) -> tuple[int, int]:
    """All parameters and the routed experts' (under an `experts` module; `shared_experts` are replicated)."""
    described = describe_model(options.model_spec)
    with torch.device("meta"):
        model = build_model(described, seed=options.seed)
    named = [(name.split("."), p.numel()) for name, p in model.named_parameters()]
    return sum(n for _, n in named), sum(n for parts, n in named if "experts" in parts)


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
        precision=options.precision,
    )


def _plan_lines(options: DemoOptions, world: int) -> list[str]:
    """cx-plan's step-time prediction of this run on this machine's device (`cx_plugins.plan`)."""
    shape = load_model_shape(
        options.model, hidden_size=options.hidden_size, num_layers=options.num_layers, seq_len=options.seq_len
    )
    device = detect_device()
    candidate = plan_candidate(options, world)
    step = predict_step_time(candidate, shape, options.seq_len, device)
    comm = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in step.communication_s.items()) or "none"
    return [
        f"# predicted step on {world} x {device.name} (cx-plan, {ACHIEVABLE_FRACTION:.0%} of peak): "
        f"{step.step_s * 1e3:.2f} ms, {step.tokens_per_s:,.0f} tokens/s, MFU {step.mfu:.1%}",
        f"#   compute {step.compute_s * 1e3:.2f} ms (recompute {step.recompute_s * 1e3:.2f}), pipeline bubble "
        f"{step.bubble_s * 1e3:.2f} ms, optimizer {step.optimizer_s * 1e3:.2f} ms; communication: {comm}",
    ]


def _mib(count: int) -> str:
    return f"{count / 2**20:,.1f} MiB"


def dry_run_report(options: DemoOptions, world_size: int | None = None) -> str:
    world = options.nproc if world_size is None else world_size
    lines = ["# cx-train --dry-run: nothing is trained", resolved_toml(dict(options.resolved)).rstrip()]
    lines.append(f"# parallel layout: {options.plugin} on {world} ranks (mesh order, outermost first)")
    lines += [f"#   {row}" for row in layout_rows(options, world)]
    parameters, experts = _count_parameters(options)
    figures = memory_figures(options, parameters, world, experts)
    split = f"tp x pp {options.tp} x {options.pp}" + (f", experts over ep {options.ep}" if experts else "")
    lines += [
        f"# parameters: {figures.parameters:,} in the model, {figures.parameters_per_rank:,} per rank ({split}, "
        "layers split evenly)",
        f"# memory per rank ({options.precision}, estimate without activations): weights "
        f"{_mib(figures.weight_bytes)}, gradients {_mib(figures.gradient_bytes)}, optimizer state "
        f"{_mib(figures.optimizer_bytes)}, total {_mib(figures.total_bytes)}",
        *_plan_lines(options, world),
    ]
    return "\n".join(lines) + "\n"
