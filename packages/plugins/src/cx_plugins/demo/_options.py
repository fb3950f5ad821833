"""The demo's command line, parsed and validated once into a frozen `DemoOptions`.

Everything that can be checked before a process starts is checked here, with errors that name the flag and the
values that would work: the flags against the plugin, the parallel layout against the world size, and `--model`
against the data (its config and tokenizer are read, no weights).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import cx_plugins
from cx_plugins.demo._models import GPT_MODEL, MODEL_CHOICES, PRESETS, DemoModel, ModelError, ModelSpec, describe_model

__all__ = ["HYBRID_CLASSES", "PLUGINS", "DemoOptions", "parse_options", "plugin_missing"]

HYBRID_CLASSES = {"hybrid": "HybridParallelPlugin", "moe_hybrid": "MoeHybridParallelPlugin"}
PLUGINS = ("gemini", "low_level_zero", "torch_ddp", "torch_fsdp", *HYBRID_CLASSES)
PRECISIONS = ("fp32", "bf16", "fp16")
PP_STYLES = ("1f1b", "interleaved")
_DEFAULT_HIDDEN, _DEFAULT_LAYERS = 128, 2


@dataclass(frozen=True)
class DemoOptions:
    plugin: str
    nproc: int
    steps: int
    batch_size: int
    seq_len: int
    hidden_size: int
    num_layers: int
    lr: float
    precision: str
    seed: int
    log_every: int
    save: Path | None
    save_every: int
    resume: Path | None
    model: str = GPT_MODEL  # "gpt", a preset name, or a transformers model folder
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1
    zero: int = 0
    microbatches: int = 1  # pipeline micro-batches per step (the pipeline size unless --microbatches says)
    pp_style: str = PP_STYLES[0]

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.hidden_size, self.num_layers, self.seq_len)

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that see different batches: the world over the tensor, pipeline and sequence groups."""
        return world_size // (self.tp * self.pp * self.sp)


def plugin_missing(plugin: str) -> str | None:
    """Why `plugin` cannot be used with this installation of cx-plugins (None when it can)."""
    name = HYBRID_CLASSES.get(plugin)
    if name is None or hasattr(cx_plugins, name):
        return None
    return f"--plugin {plugin}: {name} is not available yet in this cx-plugins ({cx_plugins.__version__})"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cx-train",
        description="Train a language model on an embedded text dataset with a chosen plugin on N local processes.",
    )
    parser.add_argument(
        "--plugin", choices=PLUGINS, default=PLUGINS[0], help="parallel strategy (default: %(default)s)"
    )
    parser.add_argument(
        "--model",
        default=GPT_MODEL,
        metavar="{" + ",".join(MODEL_CHOICES) + "} or DIR",
        help="cx's reference GPT (default), a tiny transformers preset built from a config (no download), "
        "or a local transformers model folder (config.json and weights; its tokenizer when present)",
    )
    parser.add_argument("--nproc", type=_positive, default=2, help="processes on this machine (default: %(default)s)")
    parser.add_argument("--steps", type=_positive, default=200, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--batch-size", type=_positive, default=8, help="sequences per data-parallel rank per step")
    parser.add_argument("--seq-len", type=_positive, default=64, help="tokens per sequence")
    parser.add_argument(
        "--hidden-size", type=_positive, default=None, help=f"built-in models (default {_DEFAULT_HIDDEN})"
    )
    parser.add_argument(
        "--num-layers", type=_positive, default=None, help=f"built-in models (default {_DEFAULT_LAYERS})"
    )
    parser.add_argument("--lr", type=_positive_float, default=1e-3)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--seed", type=int, default=1024)
    parser.add_argument("--log-every", type=_positive, default=10, help="steps between progress lines")
    parser.add_argument("--save", type=Path, default=None, help="checkpoint directory (written at the end)")
    parser.add_argument("--save-every", type=int, default=0, help="also checkpoint every N steps (needs --save)")
    parser.add_argument("--resume", type=Path, default=None, help="continue from a cx-train checkpoint directory")
    hybrid = parser.add_argument_group("hybrid parallelism (--plugin hybrid / moe_hybrid)")
    hybrid.add_argument("--tp", type=_positive, default=None, help="tensor-parallel size (default 1)")
    hybrid.add_argument("--pp", type=_positive, default=None, help="pipeline stages (default 1)")
    hybrid.add_argument("--ep", type=_positive, default=None, help="expert-parallel size, moe_hybrid (default 1)")
    hybrid.add_argument("--sp", type=_positive, default=None, help="sequence-parallel size, all_to_all (default 1)")
    hybrid.add_argument("--zero", type=int, choices=(0, 1, 2), default=None, help="ZeRO stage (default 0)")
    hybrid.add_argument("--microbatches", type=_positive, default=None, help="per step with --pp (default: --pp)")
    hybrid.add_argument("--pp-style", choices=PP_STYLES, default=None, help="pipeline schedule (default 1f1b)")
    return parser


_HYBRID_FLAGS = ("tp", "pp", "ep", "sp", "zero", "microbatches", "pp_style")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _multiples(base: int, count: int = 3) -> str:
    return ", ".join(str(base * i) for i in range(1, count + 1))


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)


def _flag_problem(args: argparse.Namespace) -> str | None:
    given = [name for name in _HYBRID_FLAGS if getattr(args, name) is not None]
    if given and args.plugin not in HYBRID_CLASSES:
        return f"{_flag(given[0])} applies to --plugin hybrid or moe_hybrid only (not {args.plugin})"
    if args.ep is not None and args.plugin != "moe_hybrid":
        return "--ep (expert parallelism) applies to --plugin moe_hybrid only"
    pp = args.pp or 1
    if pp == 1 and (args.microbatches is not None or args.pp_style is not None):
        return f"{'--microbatches' if args.microbatches is not None else '--pp-style'} needs --pp 2 or more"
    if args.model not in MODEL_CHOICES:
        sized = [f for f in ("hidden_size", "num_layers") if getattr(args, f) is not None]
        if sized:
            return f"{_flag(sized[0])} applies to the built-in models; the folder {args.model} has its own config"
    if args.model in PRESETS and (args.hidden_size or _DEFAULT_HIDDEN) % 8:
        return f"--hidden-size must be a multiple of 8 for --model {args.model} (4 heads), got {args.hidden_size}"
    if (args.hidden_size or _DEFAULT_HIDDEN) % 4:
        return f"--hidden-size must be a multiple of 4 (the model has 4 heads), got {args.hidden_size}"
    return None


def _layout_problem(options: DemoOptions, world_size: int) -> str | None:
    dense = options.tp * options.pp * options.sp
    if world_size % dense:
        return (
            f"{world_size} processes do not split into tp {options.tp} x pp {options.pp} x sp {options.sp} = {dense}: "
            f"use --nproc {_multiples(dense)}, or sizes whose product divides {world_size} ({_divisors(world_size)})"
        )
    dp = options.data_parallel_size(world_size)
    if dp % options.ep:
        return (
            f"--ep {options.ep} must divide the data-parallel size {dp} (processes / (tp*pp*sp)): "
            f"use --ep {_divisors(dp)}"
        )
    if options.pp > 1 and options.batch_size % options.microbatches:
        return (
            f"--batch-size {options.batch_size} does not split into {options.microbatches} micro-batches: "
            f"use --microbatches {_divisors(options.batch_size)}"
        )
    if options.seq_len % options.sp:
        return f"--seq-len {options.seq_len} must be a multiple of --sp {options.sp}"
    return None


def _model_problem(options: DemoOptions, described: DemoModel) -> str | None:
    chunks = 2 if options.pp_style == "interleaved" else 1
    if described.num_layers % (options.pp * chunks):
        return (
            f"the model's {described.num_layers} layers do not split into {options.pp} stages x {chunks} chunks: "
            f"use --pp {_divisors(described.num_layers)}"
        )
    heads = math.gcd(described.num_heads, described.num_kv_heads)
    if heads % (options.tp * options.sp):
        return (
            f"the model's {described.num_heads} attention / {described.num_kv_heads} key-value heads do not split "
            f"over tp {options.tp} x sp {options.sp}: tp x sp must be one of {_divisors(heads)}"
        )
    model_type = getattr(described.config, "model_type", None)
    if model_type == "deepseek_v3" and options.pp > 1:
        return (
            "--pp with a DeepSeek-V3 model is not supported by cx yet (cx-pipeline cannot split it into stages); "
            "use --model mixtral or qwen3_moe, or --pp 1"
        )
    if options.plugin == "moe_hybrid" and not described.num_experts:
        return f"--plugin moe_hybrid needs a model with experts (mixtral, qwen3_moe, deepseek_v3), not {options.model}"
    if described.num_experts and described.num_experts % options.ep:
        experts = described.num_experts
        return f"--ep {options.ep} must divide the model's {experts} experts: use --ep {_divisors(experts)}"
    return None


def _resume_problem(resume: Path, args: argparse.Namespace) -> str | None:
    state = resume / "trainer.json"
    if not state.is_file():
        return f"--resume {resume}: not a complete cx-train checkpoint (no trainer.json)"
    saved = json.loads(state.read_text())
    trained = saved.get("model", GPT_MODEL)
    if trained != args.model and (trained in MODEL_CHOICES or args.model in MODEL_CHOICES):
        return f"--resume {resume}: the checkpoint is of --model {trained}, not {args.model}; pass --model {trained}"
    for name, default in (("hidden_size", _DEFAULT_HIDDEN), ("num_layers", _DEFAULT_LAYERS)):
        wanted, given = saved.get(name), getattr(args, name) or default
        if wanted is not None and wanted != given:
            return f"--resume {resume}: the checkpoint's model has {_flag(name)} {wanted}, not {given}; pass it"
    return None


def parse_options(argv: Sequence[str] | None = None, world_size: int | None = None) -> DemoOptions:
    """Parse and validate; `world_size` is the real one under an external torchrun (default: `--nproc`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _flag_problem(args)
    if problem is not None:
        parser.error(problem)
    if args.save_every < 0 or (args.save_every and args.save is None):
        parser.error("--save-every needs --save DIR and a non-negative step count")
    if args.resume is not None:
        problem = _resume_problem(args.resume, args)
        if problem is not None:
            parser.error(problem)
    options = DemoOptions(
        plugin=args.plugin,
        nproc=args.nproc,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        hidden_size=args.hidden_size or _DEFAULT_HIDDEN,
        num_layers=args.num_layers or _DEFAULT_LAYERS,
        lr=args.lr,
        precision=args.precision,
        seed=args.seed,
        log_every=args.log_every,
        save=args.save,
        save_every=args.save_every,
        resume=args.resume,
        model=args.model,
        tp=args.tp or 1,
        pp=args.pp or 1,
        ep=args.ep or 1,
        sp=args.sp or 1,
        zero=args.zero or 0,
        microbatches=args.microbatches or args.pp or 1,
        pp_style=args.pp_style or PP_STYLES[0],
    )
    missing = plugin_missing(options.plugin)
    problem = missing or _layout_problem(options, options.nproc if world_size is None else world_size)
    if problem is not None:
        parser.error(problem)
    try:
        described = describe_model(options.model_spec)
    except ModelError as error:
        parser.error(str(error))
    problem = _model_problem(options, described)
    if problem is not None:
        parser.error(problem)
    return options
