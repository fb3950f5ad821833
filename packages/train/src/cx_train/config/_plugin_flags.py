"""cx-train's plugin switches (sequence-parallel mode, fp8 and its scaling recipe, sequence overlap, fused kernels,
Gemini placement, CPU offload, the optimizer and its states' dtype, LoRA) as argument groups of `_parser`'s parser,
with no heavy import; which plugin takes which switch is checked in `plugin_switch_problem`, before any process
starts, each refusal naming the flag and the plugins that take it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imports torch: only the validated options need it, after the flags are read
    from cx_mesh.fp8 import ScalingRecipe

__all__ = [
    "FP8_RECIPES",
    "GEMINI_NO_SP",
    "OPTIMIZERS",
    "OPTIMIZER_STATES_DTYPES",
    "PLACEMENTS",
    "SP_MODES",
    "LoraSettings",
    "PluginSwitches",
    "add_plugin_arguments",
    "lora_settings",
    "plugin_switch_problem",
    "plugin_switches",
]

SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")  # cx_plan.SP_MODES, HybridParallelPlugin's modes
SP_AXIS_MODES = ("all_to_all", "ring_attn")  # their own --sp axis; split_gather / ring split over the tp group
PLACEMENTS = ("static", "auto")  # GeminiPlugin's placement_policy
FSDP_WRAPS = ("block", "model")  # TorchFSDPPlugin: each decoder layer its own unit, or one root unit
OPTIMIZERS = ("adamw", "hybrid_adam", "fused_adam", "cpu_adam", "muon")  # torch's AdamW, cx-zero's fused Adam(W)s,
# and cx-zero's MuonWithAdamW (Muon on hidden matrices, AdamW on the rest)
OPTIMIZER_STATES_DTYPES = ("fp32", "bf16")  # cx_plan.OPTIMIZER_STATES_DTYPES, the ZeRO plugins' optimizer_states_dtype
FP8_RECIPES = ("tensorwise", "rowwise", "blockwise")  # cx_mesh.fp8.ScalingRecipe's values, the plugins' fp8_recipe
_HYBRID = ("hybrid", "moe_hybrid")
_FP8 = ("low_level_zero", "gemini", *_HYBRID)  # plugins with use_fp8
_FP8_COMMUNICATION = ("torch_ddp", *_FP8)  # plugins with fp8_communication
_CPU_OFFLOAD = ("low_level_zero", *_HYBRID)  # ZeRO 1/2 optimizer states on the CPU
_STATES_DTYPE = ("low_level_zero", "gemini", *_HYBRID)  # optimizer_states_dtype: ZeRO 1/2 and Gemini's optimizers
_WHOLE_TENSOR = (
    "torch_ddp",
    "torch_fsdp",
    "low_level_zero",
    "gemini",
    "hybrid",
    "moe_hybrid",
)  # step a matrix-wise optimizer (Muon) on whole matrices (torch_fsdp: Newton-Schulz on each matrix gathered whole to
# an owner rank)
_LORA = ("torch_ddp", "low_level_zero", "hybrid", "gemini")  # plugins whose support_lora() is True
_MERGE_LORA = ("torch_ddp", "low_level_zero")  # --merge-lora merges on one rank's full weights
DEFAULT_LORA_TARGETS = "all-linear"  # peft: every linear layer but the output head


@dataclass(frozen=True)
class PluginSwitches:
    """The plugin constructor's switches as the flags set them (None: the plugin's own default)."""

    sp_mode: str | None = None  # None: all_to_all with --sp 2 or more, else no sequence parallelism
    sequence_overlap: bool = False
    fp8: bool = False
    fp8_recipe: ScalingRecipe | None = None  # --fp8's scaling; None only where built without the flags (TENSORWISE)
    fp8_communication: bool = False
    jit_fused: bool = False
    fused_normalization: bool = False
    placement: str | None = None
    shard_fraction: float | None = None
    offload_optim_fraction: float | None = None
    offload_param_fraction: float | None = None
    cpu_offload: bool = False
    fsdp_wrap: str = "block"
    checkpoint_ratio: float | None = None  # None: --activation-checkpointing's all or nothing
    optimizer_states_dtype: str = "fp32"  # "bf16": Adam's moments in bf16 with stochastic rounding (ZeRO plugins)


@dataclass(frozen=True)
class LoraSettings:
    """`--lora-rank` and its flags: peft's LoraConfig, and whether the saved model has them merged in."""

    rank: int
    alpha: int
    targets: tuple[str, ...] | str  # module names, or peft's "all-linear"
    merge: bool = False


def plugin_switches(args: argparse.Namespace) -> PluginSwitches:
    from cx_mesh.fp8 import ScalingRecipe

    return PluginSwitches(
        sp_mode=args.sp_mode,
        sequence_overlap=args.sequence_overlap,
        fp8=args.fp8,
        fp8_recipe=ScalingRecipe(args.fp8_recipe),
        fp8_communication=args.fp8_communication,
        jit_fused=args.jit_fused,
        fused_normalization=args.fused_normalization,
        placement=args.placement,
        shard_fraction=args.shard_fraction,
        offload_optim_fraction=args.offload_optim_fraction,
        offload_param_fraction=args.offload_param_fraction,
        cpu_offload=args.cpu_offload,
        fsdp_wrap=args.fsdp_wrap or "block",
        checkpoint_ratio=args.activation_checkpointing_ratio,
        optimizer_states_dtype=args.optimizer_states_dtype,
    )


def lora_settings(args: argparse.Namespace) -> LoraSettings | None:
    if not args.lora_rank:
        return None
    names = tuple(name.strip() for name in args.lora_targets.split(",") if name.strip())
    targets: tuple[str, ...] | str = DEFAULT_LORA_TARGETS if names == (DEFAULT_LORA_TARGETS,) else names
    alpha = int(args.lora_alpha) if args.lora_alpha is not None else 2 * args.lora_rank
    return LoraSettings(args.lora_rank, alpha, targets, args.merge_lora)


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def _rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 (no LoRA) or more, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _rank(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be a positive integer, got 0")
    return value


def add_plugin_arguments(parser: argparse.ArgumentParser) -> None:
    switches = parser.add_argument_group("plugin switches (each refused by name where its plugin has none)")
    switches.add_argument(
        "--sp-mode",
        choices=SP_MODES,
        default=None,
        help="sequence parallelism, hybrid / moe_hybrid: split_gather and ring split the sequence over the --tp "
        "group (need --tp 2 or more), all_to_all (Ulysses) and ring_attn over their own --sp axis (default: "
        "all_to_all with --sp 2 or more, else off)",
    )
    switches.add_argument(
        "--sequence-overlap",
        action="store_true",
        help="overlap split_gather's all-gather / reduce-scatter with the matmuls (enable_sequence_overlap); needs "
        "--sp-mode split_gather; with --fp8 / --fp8-communication the ring computes / sends in fp8 (default: off)",
    )
    switches.add_argument(
        "--fp8",
        action="store_true",
        help=f"linear layers' matmuls in fp8 (use_fp8): {', '.join(_FP8)}; needs a GPU with fp8 (default: off)",
    )
    switches.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default="tensorwise",
        help="--fp8's scaling (fp8_recipe): one scale per tensor, per row, or per tile (blockwise: DeepSeek-V3's "
        "1x128 activation / 128x128 weight tiles); needs --fp8 unless tensorwise (default: tensorwise)",
    )
    switches.add_argument(
        "--fp8-communication",
        action="store_true",
        help=f"gradients / activations communicated in fp8: {', '.join(_FP8_COMMUNICATION)} (default: off)",
    )
    switches.add_argument(
        "--jit-fused",
        action="store_true",
        help="ShardFormer's fused dropout-add / bias kernels (enable_jit_fused), hybrid / moe_hybrid (default: off)",
    )
    switches.add_argument(
        "--fused-normalization",
        action="store_true",
        help="ShardFormer's fused layer / RMS norm (enable_fused_normalization), hybrid / moe_hybrid (default: off)",
    )
    switches.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=None,
        help="gemini's placement_policy: static keeps the fractions below, auto moves chunks by memory use "
        "(default: static)",
    )
    switches.add_argument(
        "--shard-fraction",
        type=_fraction,
        metavar="F",
        default=None,
        help="gemini, static placement: fraction of the parameters sharded (shard_param_frac) (default: 1.0)",
    )
    switches.add_argument(
        "--offload-optim-fraction",
        type=_fraction,
        metavar="F",
        default=None,
        help="gemini, static placement: fraction of the optimizer states on the CPU (default: 0.0)",
    )
    switches.add_argument(
        "--offload-param-fraction",
        type=_fraction,
        metavar="F",
        default=None,
        help="gemini, static placement: fraction of the fp32 master weights on the CPU; needs "
        "--offload-optim-fraction 1 and --shard-fraction 1 (default: 0.0)",
    )
    switches.add_argument(
        "--cpu-offload",
        action="store_true",
        help="ZeRO 1/2 optimizer states and their step on the CPU: low_level_zero, or hybrid / moe_hybrid with "
        "--zero 1 or 2 (default: off)",
    )
    switches.add_argument(
        "--fsdp-wrap",
        choices=FSDP_WRAPS,
        default=None,
        help="torch_fsdp: block shards each decoder layer as its own unit (a step gathers one block at a time), "
        "model one root unit (default: block)",
    )
    switches.add_argument(
        "--activation-checkpointing-ratio",
        type=_fraction,
        metavar="F",
        default=None,
        help="hybrid / moe_hybrid: recompute this fraction of the decoder layers (ShardFormer's "
        "gradient_checkpointing_ratio); 1 is --activation-checkpointing (default: 0, or 1 with it)",
    )
    switches.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw: torch's AdamW; hybrid_adam / fused_adam / cpu_adam: cx-zero's fused Adam(W) (the same "
        "update; cpu_adam steps parameters that live on the CPU, as with --cpu-offload); muon: cx-zero's "
        "MuonWithAdamW (Muon on hidden matrices, AdamW on 1-D parameters, embeddings and the output head, one "
        "--lr / --weight-decay: Muon's match_rms_adamw scaling; each expert of a fused MoE stack orthogonalised on its "
        "own); torch_ddp, torch_fsdp, low_level_zero, gemini, hybrid and moe_hybrid",
    )
    switches.add_argument(
        "--optimizer-states-dtype",
        choices=OPTIMIZER_STATES_DTYPES,
        default="fp32",
        help="Adam's moments between steps (optimizer_states_dtype): bf16 halves their memory, stored with "
        "stochastic rounding; low_level_zero, gemini, or hybrid / moe_hybrid with --zero 1 or 2",
    )
    lora = parser.add_argument_group(
        "LoRA (peft; --plugin torch_ddp, low_level_zero, hybrid or gemini, transformers models)"
    )
    lora.add_argument(
        "--lora-rank",
        type=_rank,
        metavar="N",
        default=0,
        help="train LoRA adapters of this rank instead of the weights; checkpoints hold the adapters (default: 0, off)",
    )
    lora.add_argument(
        "--lora-alpha",
        type=_positive_int,
        metavar="A",
        default=None,
        help="LoRA's scale numerator: adapters add alpha / rank x B A (default: 2 x --lora-rank)",
    )
    lora.add_argument(
        "--lora-targets",
        default=DEFAULT_LORA_TARGETS,
        metavar="NAMES",
        help="comma-separated module names that get adapters (e.g. q_proj,v_proj); all-linear: every linear "
        "layer but the output head",
    )
    lora.add_argument(
        "--merge-lora",
        action="store_true",
        help="also save the weights with the adapters merged in (model/, loadable without peft) (default: off)",
    )


GEMINI_NO_SP = (
    "cx-train has no flag for GeminiPlugin's sequence parallelism (--plugin gemini takes --tp alone); "
    "use --plugin hybrid or moe_hybrid"
)


def _not_for(flag: str, plugin: str, plugins: tuple[str, ...]) -> str:
    return f"{flag} is not supported by --plugin {plugin}; use --plugin {' or '.join(plugins)}"


def _sequence_problem(args: argparse.Namespace) -> str | None:
    mode, tp, sp = args.sp_mode, args.tp or 1, args.sp or 1
    if mode is not None and args.plugin == "gemini":  # GeminiPlugin has sequence parallelism; cx-train's flags don't
        return f"--sp-mode {mode}: {GEMINI_NO_SP}"
    if mode is not None and args.plugin not in _HYBRID:
        return _not_for(f"--sp-mode {mode}", args.plugin, _HYBRID)
    if mode in ("split_gather", "ring"):
        if tp == 1:
            return f"--sp-mode {mode} splits the sequence over the tensor-parallel group: it needs --tp 2 or more"
        if sp > 1:
            return f"--sp-mode {mode} runs on the --tp group, not an --sp axis: drop --sp {sp} (or use all_to_all)"
    if mode in SP_AXIS_MODES and sp == 1:
        return f"--sp-mode {mode} splits the sequence over its own axis: give --sp 2 or more"
    if args.sequence_overlap and mode != "split_gather":
        return "--sequence-overlap overlaps split_gather's collectives: it needs --sp-mode split_gather"
    return None


def plugin_switch_problem(args: argparse.Namespace) -> str | None:
    """Why the plugin switches in `args` cannot run with `--plugin` and each other (None when they can)."""
    plugin = args.plugin
    problem = _sequence_problem(args)
    if problem is not None:
        return problem
    if args.fp8 and plugin not in _FP8:
        return _not_for("--fp8", plugin, _FP8)
    if args.fp8_recipe != "tensorwise" and not args.fp8:
        return f"--fp8-recipe {args.fp8_recipe} sets how --fp8 scales its matmuls: it needs --fp8"
    if args.fp8_communication and plugin not in _FP8_COMMUNICATION:
        return _not_for("--fp8-communication", plugin, _FP8_COMMUNICATION)
    for flag, on in (("--jit-fused", args.jit_fused), ("--fused-normalization", args.fused_normalization)):
        if on and plugin not in _HYBRID:
            return _not_for(flag, plugin, _HYBRID)
    gemini = ("placement", "shard_fraction", "offload_optim_fraction", "offload_param_fraction")
    given = [f"--{name.replace('_', '-')}" for name in gemini if getattr(args, name) is not None]
    if given and plugin != "gemini":
        return _not_for(given[0], plugin, ("gemini",))
    if args.placement == "auto" and len(given) > 1:
        return f"{given[1]} sets a static placement's fractions; --placement auto moves chunks itself"
    if (args.offload_param_fraction or 0.0) > 0 and (
        (args.shard_fraction or 1.0) != 1.0 or args.offload_optim_fraction != 1.0
    ):
        return (
            "--offload-param-fraction offloads master weights only with every parameter sharded and every "
            "optimizer state offloaded: give --offload-optim-fraction 1 (and --shard-fraction 1, the default)"
        )
    if args.fsdp_wrap is not None and plugin != "torch_fsdp":
        return _not_for(f"--fsdp-wrap {args.fsdp_wrap}", plugin, ("torch_fsdp",))
    if args.activation_checkpointing_ratio is not None and plugin not in _HYBRID:
        return (
            f"{_not_for('--activation-checkpointing-ratio', plugin, _HYBRID)} (the other plugins checkpoint all "
            "layers or none: --activation-checkpointing)"
        )
    if args.cpu_offload:
        if plugin not in _CPU_OFFLOAD:
            return _not_for("--cpu-offload", plugin, _CPU_OFFLOAD)
        if plugin in _HYBRID and args.zero not in (1, 2):
            return f"--cpu-offload offloads ZeRO 1/2 optimizer states: --plugin {plugin} needs --zero 1 or 2"
    problem = _muon_problem(args)
    if problem is not None:
        return problem
    if args.optimizer_states_dtype != "fp32":
        flag = f"--optimizer-states-dtype {args.optimizer_states_dtype}"
        if plugin not in _STATES_DTYPE:
            return _not_for(flag, plugin, _STATES_DTYPE) + " (its optimizer keeps fp32 moments)"
        if plugin in _HYBRID and args.zero not in (1, 2):
            return f"{flag} is ZeRO's optimizer option: --plugin {plugin} needs --zero 1 or 2"
    return _lora_problem(args)


def _muon_problem(args: argparse.Namespace) -> str | None:
    """--optimizer muon needs each matrix whole: the plugins that slice parameters for the optimizer refuse it at
    boost (cx_zero.require_elementwise), so it is refused here first; and Muon keeps fp32 states."""
    if args.optimizer != "muon":
        return None
    plugin = args.plugin
    if plugin not in _WHOLE_TENSOR:
        return (
            f"{_not_for('--optimizer muon', plugin, _WHOLE_TENSOR)} (Muon needs each matrix whole, and --plugin "
            f"{plugin} steps the optimizer on parameter slices)"
        )
    if args.optimizer_states_dtype != "fp32":
        return (
            f"--optimizer-states-dtype {args.optimizer_states_dtype} stores Adam's moments with stochastic rounding; "
            "--optimizer muon keeps fp32 states"
        )
    return None


def _lora_problem(args: argparse.Namespace) -> str | None:
    if not args.lora_rank:
        given = [
            flag
            for flag, on in (
                ("--lora-alpha", args.lora_alpha is not None),
                ("--lora-targets", args.lora_targets != DEFAULT_LORA_TARGETS),
                ("--merge-lora", args.merge_lora),
            )
            if on
        ]
        return f"{given[0]} needs --lora-rank N (LoRA on)" if given else None
    if args.plugin not in _LORA:
        return _not_for("--lora-rank", args.plugin, _LORA)
    if args.model == "gpt":
        return "--lora-rank: LoRA goes through peft, which needs a transformers model (--model llama, ... or a folder)"
    if args.merge_lora and args.plugin not in _MERGE_LORA:  # its ranks hold shards, not the weights to merge into
        return _not_for("--merge-lora", args.plugin, _MERGE_LORA)
    if not [name for name in args.lora_targets.split(",") if name.strip()]:
        return "--lora-targets: give module names, e.g. q_proj,v_proj, or all-linear"
    return None
