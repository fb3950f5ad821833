"""`cx-plan`: which configuration of which plugin fits a model on N devices and which runs fastest, said before
launch. Prints the ranked table (or `--json`); exit status 2 with a one-line error for impossible inputs (an unknown
device or link, a memory size that does not parse, a model config missing fields, a world no layout splits)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cx_plan._candidate import OPTIMIZER_STATES_DTYPES, OPTIMIZERS, PIPELINE_STYLES, PLUGINS, PRECISIONS, Optimizer
from cx_plan._devices import (
    DEVICES,
    LINKS,
    Device,
    Network,
    default_network,
    detect_device,
    lookup_device,
    lookup_link,
    parse_memory,
    parse_reserve,
)
from cx_plan._enumerate import SearchSpace
from cx_plan._expert_load import read_expert_load
from cx_plan._planner import MemoryModel, plan, traced_memory_model
from cx_plan._report import PlanRow, row_label
from cx_plan.step_time._kernels import COMPILE_SPEEDUP, FP8_GAIN, Kernels
from cx_plan.step_time._step_time import ACHIEVABLE_FRACTION
from cx_plan.trace._model_spec import ModelShape, load_model_shape, shadowed_builtin

if TYPE_CHECKING:
    from cx_plan.measure._measure import Measured

__all__ = ["build_parser", "main"]

MemoryFactory = Callable[[ModelShape, int, Device], MemoryModel]


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not already say its default and there is one to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cx-plan",
        description="Rank every plugin configuration of a model on N devices by predicted memory fit and step time.",
        formatter_class=_DefaultsHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="gpt, a preset (gpt2, llama, mixtral, ...), DIR or config.json")
    parser.add_argument("--world", type=int, required=True, help="devices (ranks) in all")
    parser.add_argument("--device", default="h100", help=f"one of {', '.join(DEVICES)}")
    parser.add_argument(
        "--device-memory",
        default=None,
        help="memory per device: 80GB (10^9 bytes) or 80GiB (2^30) (default: what the device reports)",
    )
    parser.add_argument(
        "--reserve",
        default=None,
        help="memory held back per device (CUDA context, NCCL, fragmentation): 10%%, 0.1 or a size such as 6GiB; "
        "a peak inside it is shown as 'tight' (default: 10%%)",
    )
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    parser.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step (default: 4 per rank)"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",  # cx-train's default, so a plan without flags is of the run cx-train makes without them
        help="parameter / compute precision, as cx-train's --precision (bf16 for a GPU run)",
    )
    parser.add_argument(
        "--optimizer-states-dtype",
        choices=OPTIMIZER_STATES_DTYPES,
        default="fp32",
        help="Adam's moments, as cx-train's flag: bf16 (stochastic rounding) counts 2 + 2 bytes per parameter "
        "instead of 4 + 4 wherever the layout runs ZeRO 1/2 or Gemini (DDP, FSDP and ZeRO 0 keep fp32)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="as cx-train's flag: adamw (two fp32 moments per parameter; its fused Adam(W)s hold the same) or muon "
        "(MuonWithAdamW: one momentum per hidden-matrix element, AdamW on 1-D parameters, embeddings and the head; "
        "each parameter stepped whole on one owner rank, gathered to it and scattered back; not under torch_fsdp, "
        "hybrid or moe_hybrid ZeRO 1/2 at tp > 1)",
    )
    parser.add_argument("--plugins", default=",".join(PLUGINS), help="comma-separated plugins to consider")
    parser.add_argument("--hidden-size", type=int, default=128, help="built-in models only (as cx-train)")
    parser.add_argument("--num-layers", type=int, default=2, help="built-in models only (as cx-train)")
    parser.add_argument(
        "--checkpointing",
        default="0,1,op",
        help="activation-checkpointing ratios to try, comma-separated; 'op' adds every layer under torchtitan's "
        "selective op policy (data-parallel plugins)",
    )
    parser.add_argument("--pp-styles", default=",".join(PIPELINE_STYLES), help="pipeline schedules to try")
    parser.add_argument("--max-tp", type=int, default=8, help="largest tensor-parallel size to try")
    parser.add_argument(
        "--intra-link", default=None, help=f"link inside a node, one of {', '.join(LINKS)} (default: the device's)"
    )
    parser.add_argument("--inter-link", default=None, help="link between nodes (same names) (default: the device's)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="ranks per node (default: the device's)")
    parser.add_argument(
        "--intra-bandwidth", type=float, default=None, help="override, GB/s per direction (default: the link's)"
    )
    parser.add_argument(
        "--inter-bandwidth", type=float, default=None, help="override, GB/s per direction (default: the link's)"
    )
    parser.add_argument(
        "--intra-latency", type=float, default=None, help="override, microseconds (default: the link's)"
    )
    parser.add_argument(
        "--inter-latency", type=float, default=None, help="override, microseconds (default: the link's)"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="override the device's peak, TFLOP/s (default: the device's)"
    )
    parser.add_argument(
        "--routing-skew",
        type=float,
        default=1.0,
        help="MoE: the hottest expert's tokens over the mean expert's (>= 1; 1 is balanced); the plan predicts the "
        "worst expert-parallel rank's memory and step time",
    )
    parser.add_argument(
        "--expert-load",
        type=Path,
        default=None,
        help="MoE: a measured histogram instead of --routing-skew: cx-train's --metrics FILE.jsonl (its expert_counts) "
        "or a JSON list of per-layer token counts per expert; each ep size gets its hottest rank's share (default: "
        "none: --routing-skew)",
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="the achievable fraction of the device's peak the forward and backward reach (default: the device "
        f"row's: fitted to a published run for a100 and h100_96gb, {ACHIEVABLE_FRACTION:g} for the others)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="the step under torch.compile, as cx-train's --compile: its forward and backward compute run "
        "--compile-speedup times faster (cx-train compiles under torch_ddp only; the factor applies to every "
        "candidate); memory is predicted as eager",
    )
    parser.add_argument(
        "--compile-speedup",
        type=float,
        default=None,
        help=f"--compile's factor on the compute (default: {COMPILE_SPEEDUP:g}, fitted to torchtitan's published "
        "Llama 3.1 8B FSDP runs on H100, eager against compiled)",
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="the decoder layers' linear layers in fp8, as cx-train's --fp8 (use_fp8): their FLOPs at --fp8-gain x "
        "the row's achieved bf16 rate, at most its fp8 peak x --efficiency (devices with fp8 matmuls: "
        f"{', '.join(name for name, row in DEVICES.items() if 'fp8' in row.peak_flops)}); attention and the output "
        "head stay in --precision",
    )
    parser.add_argument(
        "--fp8-gain",
        type=float,
        default=None,
        help=f"--fp8's rate over the achieved bf16 rate, scaling and casts included (default: {FP8_GAIN:g}, fitted "
        "to torchtitan's published Llama 3.1 8B Float8 run on H100)",
    )
    parser.add_argument("--top", type=int, default=10, help="fitting rows to print")
    parser.add_argument(
        "--all",
        action="store_true",
        help="judge the memory of every candidate (default: fastest predicted first, until --top fit)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the ranked plan as JSON (with --measure, a 'measured' list too)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also run the --top fitting ones here, side by side (--device must be this machine's)",
    )
    parser.add_argument("--steps", type=int, default=3, help="--measure: timed steps after one warm-up step")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=600.0,
        help="seconds of search after which the best found so far is printed, saying it stopped",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    return parser


def _progress_line(quiet: bool) -> Callable[[int, int, int], None] | None:
    """A progress line on stderr, rewritten in place at most twice a second (None when --quiet)."""
    if quiet:
        return None
    start, last = time.monotonic(), [0.0]

    def show(judged: int, total: int, fitting: int) -> None:
        now = time.monotonic()
        if now - last[0] < 0.5 and judged < total:
            return
        last[0] = now
        print(f"\rcx-plan: judged {judged} of at most {total} candidates, {fitting} fit, {now - start:.0f} s",
              end="", file=sys.stderr, flush=True)  # fmt: skip

    return show


def _floats(text: str, what: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--{what} takes comma-separated numbers, got {text!r}") from None


def _without_op(text: str) -> str:
    """--checkpointing without its 'op' entry (the selective op policy, not a ratio)."""
    return ",".join(part for part in _names(text) if part != "op")


def _routing_skew(value: float) -> float:
    if not value >= 1:
        raise ValueError(f"--routing-skew must be >= 1 (the hottest expert's tokens over the mean's), got {value:g}")
    return value


def _kernels(args: argparse.Namespace) -> Kernels:
    """--compile / --fp8 with their rates; a rate without its switch is an error (it would change nothing)."""
    for switch, rate in (("compile", "compile_speedup"), ("fp8", "fp8_gain")):
        if getattr(args, rate) is not None and not getattr(args, switch):
            flag = "--" + rate.replace("_", "-")
            raise ValueError(f"{flag} takes effect only with --{switch}: add --{switch} or drop {flag}")
    speedup = COMPILE_SPEEDUP if args.compile_speedup is None else args.compile_speedup
    fp8 = FP8_GAIN if args.fp8_gain is None else args.fp8_gain
    return Kernels(speedup if args.compile else 1.0, fp8 if args.fp8 else None)


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _network(args: argparse.Namespace, device: Device) -> Network:
    base = default_network(device)
    intra = lookup_link(
        args.intra_link or base.intra.name,
        None if args.intra_bandwidth is None else args.intra_bandwidth * 1e9,
        None if args.intra_latency is None else args.intra_latency * 1e-6,
    )
    inter = lookup_link(
        args.inter_link or base.inter.name,
        None if args.inter_bandwidth is None else args.inter_bandwidth * 1e9,
        None if args.inter_latency is None else args.inter_latency * 1e-6,
    )
    per_node = base.devices_per_node if args.devices_per_node is None else args.devices_per_node
    if per_node < 1:
        raise ValueError(f"--devices-per-node must be positive, got {per_node}")
    return Network(intra, inter, per_node)


def _check_measurable(device: Device) -> None:
    """--measure runs here: a plan for another device would put its predictions beside this machine's figures."""
    here = detect_device()
    if device.name != here.name:
        raise ValueError(
            f"--measure runs the configurations on this machine's device ({here.name}), but the plan is for "
            f"--device {device.name}: its predictions would stand beside {here.name} measurements; pass "
            f"--device {here.name} to measure, or leave --measure out"
        )


def _measured_json(rows: Sequence[PlanRow], measured: Sequence[Measured]) -> list[dict[str, Any]]:
    """--json --measure: each measured configuration's predicted and measured peak and step time."""
    return [
        {
            "label": row_label(row.candidate),
            "predicted_peak_bytes": row.memory.peak_bytes,
            "measured_peak_bytes": result.peak,
            "measured_peaks_bytes": list(result.peaks),
            "rss_bytes": list(result.rss),
            "predicted_step_s": row.step.step_s,
            "measured_step_s": result.step_s,
            "error": result.error,
        }
        for row, result in zip(rows, measured, strict=True)
    ]


class MeasurementsFailed(Exception):
    """--measure ran configurations and every one failed: the output is printed and the command exits 1."""

    def __init__(self, text: str, count: int) -> None:
        super().__init__(f"all {count} measurement(s) failed: see each one's error above")
        self.text = text


def run(args: argparse.Namespace, memory_factory: MemoryFactory) -> str:
    """The report text (or JSON) for parsed arguments; with --measure, the measurements beside it (both forms)."""
    memory_bytes = None if args.device_memory is None else parse_memory(args.device_memory)
    peak = None if args.peak_tflops is None else args.peak_tflops * 1e12
    device = lookup_device(args.device, memory_bytes, peak)
    if args.reserve is not None:
        device = lookup_device(args.device, memory_bytes, peak, parse_reserve(args.reserve, device.memory_bytes))
    if args.measure:
        _check_measurable(device)
    network = _network(args, device)
    kernels = _kernels(args)
    if kernels.fp8 and "fp8" not in device.peak_flops:
        fp8 = ", ".join(name for name, row in DEVICES.items() if "fp8" in row.peak_flops)
        raise ValueError(f"--fp8: device {device.name} has no fp8 matmuls in the table (devices with them: {fp8})")
    space = SearchSpace(
        plugins=_names(args.plugins),
        global_batch=args.global_batch,
        checkpoint_ratios=_floats(_without_op(args.checkpointing), "checkpointing"),
        checkpoint_modes=("full", "selective-op") if "op" in _names(args.checkpointing) else ("full",),
        pp_styles=_names(args.pp_styles),
        max_tp=args.max_tp,
        precision=args.precision,
        optimizer_states_dtype=args.optimizer_states_dtype,
        routing_skew=_routing_skew(args.routing_skew),
        expert_load=None if args.expert_load is None else read_expert_load(args.expert_load),
        optimizer=Optimizer(args.optimizer),
    )
    if shadowed_builtin(args.model):
        said = f"cx-plan: --model {args.model} is both a built-in model and a path here: planning the path "
        print(said + f"./{args.model} (an existing path wins); rename it to plan the built-in one", file=sys.stderr)
    shape = load_model_shape(args.model, hidden_size=args.hidden_size, num_layers=args.num_layers, seq_len=args.seq_len)
    memory = memory_factory(shape, args.seq_len, device)
    report = plan(
        shape,
        args.world,
        args.seq_len,
        device,
        memory,
        space=space,
        network=network,
        efficiency=args.efficiency,
        enough=None if args.all else args.top,
        progress=_progress_line(args.quiet),
        time_limit=args.time_limit,
        kernels=kernels,
    )
    if not args.quiet:
        print(file=sys.stderr)  # end the progress line
    if not args.measure:
        return json.dumps(report.as_json(), indent=1) if args.json else report.table(top=args.top)
    # plan/_measure.py spawns ranks, so it is imported only when asked for
    from cx_plan.measure._measure import measure_report, measure_table

    rows, measured = measure_report(report, shape.name, hidden=args.hidden_size, layers=args.num_layers,
                                    top=args.top, steps=args.steps)  # fmt: skip
    if args.json:
        text = json.dumps({**report.as_json(), "measured": _measured_json(rows, measured)}, indent=1)
    else:
        text = report.table(top=args.top) + "\n\n" + measure_table(rows, measured)
    if measured and all(result.error for result in measured):
        raise MeasurementsFailed(text, len(measured))
    return text


def main(argv: Sequence[str] | None = None, memory_factory: MemoryFactory | None = None) -> int:
    args = build_parser().parse_args(argv)
    factory = traced_memory_model if memory_factory is None else memory_factory
    try:
        print(run(args, factory))
    except MeasurementsFailed as failed:
        print(failed.text)
        print(f"cx-plan: error: {failed}", file=sys.stderr)
        return 1
    except ValueError as error:  # ModelShapeError, NoLayoutError, unknown names, unparsable sizes
        print(f"cx-plan: error: {error}", file=sys.stderr)
        return 2
    return 0
