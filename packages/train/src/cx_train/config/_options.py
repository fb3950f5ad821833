"""cx-train's command line, parsed and validated once into a frozen `TrainOptions`.

Everything that can be checked before a process starts is checked here, with errors that name the flag and the
values that would work: the flags against the plugin, the `--save` / `--resume` paths and the resumed `trainer.json`
(`_paths`), the parallel layout against the world size, and `--model` against the data (its config and tokenizer are
read, no weights). The flags themselves, their value types and --help are `_parser`'s, read from the command line by
`_arguments` before this module's imports (torch, cx-plugins) are paid for.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cx_plugins
from cx_train.checkpoint._saved_shapes import saved_shapes
from cx_train.checkpoint._trainer_state import read_trainer_state
from cx_train.config._arguments import parse_arguments
from cx_train.config._data_flags import data_problem, data_settings
from cx_train.config._launch_flags import Rendezvous, rendezvous_of
from cx_train.config._parser import (
    DEFAULT_HIDDEN,
    DEFAULT_LAYERS,
    DEFAULT_TIMEOUT_S,
    HYBRID_CLASSES,
    PLUGINS,
    PP_LAYER_SPLITS,
    PP_STYLES,
    build_parser,
)
from cx_train.config._paths import outputs_problem, resume_problem, save_problem
from cx_train.config._plugin_flags import (
    GEMINI_NO_SP,
    SP_AXIS_MODES,
    LoraSettings,
    PluginSwitches,
    lora_settings,
    plugin_switch_problem,
    plugin_switches,
)
from cx_train.config._reporting_flags import reporting_problem
from cx_train.config._resumed_model import (
    adapter_problem,
    embedded_text_message,
    resumed_model_problem,
    resumed_run_problem,
    tokenizer_problem,
)
from cx_train.config._training_checks import training_problem
from cx_train.data._tokenizers import ByteTokenizer
from cx_train.data._user_data import DataSettings, prepared_data_problem
from cx_train.models._plugins import plan_candidate
from cx_train.models._shapes import model_shapes
from cx_train.models._spec import (
    GPT_MODEL,
    MODEL_CHOICES,
    PRESETS,
    DescribedModel,
    ModelError,
    ModelSpec,
    check_builds,
    describe_model,
)
from cx_train.models._tokenizer_files import tokenizer_identity

__all__ = ["HYBRID_CLASSES", "PLUGINS", "TrainOptions", "parse_options", "plugin_missing", "validated_options"]


@dataclass(frozen=True)
class TrainOptions:
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
    max_restarts: int = 0  # --max-restarts: torchrun restarts the ranks, which resume from --save
    restart: int = 0  # which restart this run is (torchrun's TORCHELASTIC_RESTART_COUNT), set on the ranks
    rendezvous: Rendezvous | None = None  # --nnodes and its flags (_launch_flags); None: this machine alone
    resized_from: int | None = None  # a restart at another data-parallel size: the checkpoint's (checkpoint._restart)
    verify: bool = True  # --resume checks the checkpoint's checksums first (--no-verify skips it)
    model: str = GPT_MODEL  # "gpt", a preset name, or a transformers model folder
    tp: int = 1
    pp: int = 1
    ep: int = 1
    sp: int = 1
    zero: int = 0  # the ZeRO stage of hybrid / moe_hybrid, or of low_level_zero (where 0 means its default, 2)
    microbatches: int = 1  # pipeline micro-batches per step (the pipeline size unless --microbatches says)
    pp_style: str = PP_STYLES[0]
    pp_layers: str = PP_LAYER_SPLITS[0]  # --pp-layers: "even" or "balanced" (by cost)
    timeout: float = DEFAULT_TIMEOUT_S  # seconds: the process groups' and named collectives' timeout
    data: DataSettings | None = None  # --data and its flags (_data_flags); None: the embedded grammar text
    eval_every: int = 0  # steps between evaluations (0: only at the end), with --eval-data / --eval-fraction
    metrics: Path | None = None  # --metrics FILE.jsonl (_reporting)
    tensorboard: Path | None = None  # --tensorboard DIR
    # optimisation (_training_flags) and the config file (_config_file)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_accum: int = 1  # micro-batches per optimizer step
    clip: float = 0.0  # max global gradient norm, 0 for no clipping
    activation_checkpointing: bool = False
    checkpoint_mode: str = "full"  # --activation-checkpointing-mode: full or selective-op (which turns it on)
    compile: bool = False
    compile_backend: str = "inductor"  # torch.compile's backend (--compile-backend)
    dry_run: bool = False
    switches: PluginSwitches = field(default_factory=PluginSwitches)  # the plugin switches (_plugin_flags)
    optimizer: str = "adamw"  # --optimizer
    lora: LoraSettings | None = None  # --lora-rank and its flags; None: the weights themselves train
    resolved: tuple[tuple[str, Any], ...] = ()  # every flag's value after --config and the command line

    @property
    def model_spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.hidden_size, self.num_layers, self.seq_len, own_data=self.data is not None)

    @property
    def sp_mode(self) -> str | None:
        """The sequence-parallel mode that runs: --sp-mode, or all_to_all where --sp alone is given."""
        return self.switches.sp_mode or ("all_to_all" if self.sp > 1 else None)

    @property
    def sequence_split(self) -> int:
        """How many ways one sequence is split: over --sp (all_to_all, ring_attn) or over --tp (split_gather, ring)."""
        mode = self.sp_mode
        return 1 if mode is None else self.sp if mode in SP_AXIS_MODES else self.tp

    @property
    def window_length(self) -> int:
        """Tokens per training window: --seq-len + 1 (the model shifts the labels itself), or --seq-len when the
        sequence is split, which must then divide evenly."""
        return self.seq_len + (self.sequence_split == 1)

    def data_parallel_size(self, world_size: int) -> int:
        """Ranks that see different batches: the world over the tensor, pipeline and sequence groups."""
        return world_size // (self.tp * self.pp * self.sp)


def plugin_missing(plugin: str) -> str | None:
    """Why `plugin` cannot be used with this installation of cx-plugins (None when it can)."""
    name = HYBRID_CLASSES.get(plugin)
    if name is None or hasattr(cx_plugins, name):
        return None
    return f"--plugin {plugin}: {name} is not available yet in this cx-plugins ({cx_plugins.__version__})"


_HYBRID_FLAGS = ("tp", "pp", "ep", "sp", "zero", "microbatches", "pp_style", "pp_layers")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _multiples(base: int, count: int = 3) -> str:
    return ", ".join(str(base * i) for i in range(1, count + 1))


def _divisors(value: int) -> str:
    return ", ".join(str(d) for d in range(1, value + 1) if value % d == 0)


def _flag_problem(args: argparse.Namespace) -> str | None:
    given = [name for name in _HYBRID_FLAGS if getattr(args, name) is not None]
    if args.plugin == "low_level_zero" and args.zero is not None:  # LowLevelZero's stage is the one flag it takes
        if args.zero == 0:
            return "--zero 0 is not a LowLevelZero stage: --plugin low_level_zero runs --zero 1 or 2 (default 2)"
        given.remove("zero")
    if args.plugin == "gemini" and args.tp is not None:  # GeminiPlugin's tp_size: ShardFormer, then chunks over dp
        given.remove("tp")
    if given and args.plugin not in HYBRID_CLASSES:
        if given[0] == "tp":
            return f"--tp applies to --plugin hybrid, moe_hybrid or gemini only (not {args.plugin})"
        if given[0] == "sp" and args.plugin == "gemini":
            return f"--sp: {GEMINI_NO_SP}"
        alone = "; gemini takes --tp alone" if args.plugin == "gemini" else ""
        return f"{_flag(given[0])} applies to --plugin hybrid or moe_hybrid only (not {args.plugin}{alone})"
    if args.ep is not None and args.plugin != "moe_hybrid":
        return "--ep (expert parallelism) applies to --plugin moe_hybrid only"
    pp = args.pp or 1
    pipeline_only = [name for name in ("microbatches", "pp_style", "pp_layers") if getattr(args, name) is not None]
    if pp == 1 and pipeline_only:
        return f"{_flag(pipeline_only[0])} needs --pp 2 or more"
    if args.model not in MODEL_CHOICES:
        sized = [f for f in ("hidden_size", "num_layers") if getattr(args, f) is not None]
        if sized:
            return f"{_flag(sized[0])} applies to the built-in models; the folder {args.model} has its own config"
    if args.model in PRESETS and (args.hidden_size or DEFAULT_HIDDEN) % 8:
        return f"--hidden-size must be a multiple of 8 for --model {args.model} (4 heads), got {args.hidden_size}"
    if (args.hidden_size or DEFAULT_HIDDEN) % 4:
        return f"--hidden-size must be a multiple of 4 (the model has 4 heads), got {args.hidden_size}"
    return None


def _layout_problem(options: TrainOptions, world_size: int) -> str | None:
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
    if options.pp_style == "interleaved" and options.microbatches % options.pp:
        working = [m for m in range(options.pp, options.batch_size + 1, options.pp) if options.batch_size % m == 0]
        fix = (
            f"--microbatches {', '.join(map(str, working))}" if working else f"a --batch-size multiple of {options.pp}"
        )
        return (
            f"--pp-style interleaved needs --microbatches to be a multiple of --pp {options.pp}, got "
            f"{options.microbatches}: use {fix}"
        )
    if options.seq_len % options.sequence_split:
        over = f"--sp {options.sp}" if options.sp > 1 else f"--tp {options.tp} (--sp-mode {options.sp_mode})"
        return f"--seq-len {options.seq_len} must be a multiple of {over}"
    return None


def _stages_problem(options: TrainOptions, layers: int, world_size: int, microbatches: int | None) -> str | None:
    """The layers split into pp stages of `chunks` model chunks each (interleaved, zbv: 2). The suggested --pp values
    work with the other flags: they split the layers under the chosen style (a pipeline style needs --pp 2 or more), fit
    the processes, and their micro-batches (--microbatches, or by default --pp) split the batch (and, interleaved,
    are a multiple of the stages)."""
    chunks = 1 if options.pp_style == "1f1b" else 2  # interleaved and zbv: two model chunks per stage
    if layers % (options.pp * chunks) == 0:
        return None

    def works(p: int) -> bool:
        m = microbatches or p
        fits = layers % (p * chunks) == 0 and world_size % (options.tp * options.sp * p) == 0
        return fits and options.batch_size % m == 0 and (chunks == 1 or m % p == 0)

    working = [p for p in range(2, layers // chunks + 1) if works(p)]
    problem = (
        f"the model's {layers} layers do not split into {options.pp} stages x {chunks} chunk(s) ({options.pp_style})"
    )
    fixes = [f"--pp {', '.join(map(str, working))}"] if working else []
    if chunks > 1 and layers % options.pp == 0:
        fixes.append("--pp-style 1f1b")
    if options.model in MODEL_CHOICES:
        fixes.append(f"--num-layers {options.pp * chunks} (or a multiple)")
    if not fixes:
        return f"{problem}, and no --pp that fits {world_size} processes does; use --pp 1"
    return f"{problem}: use {' or '.join(fixes)}"


def _model_problem(
    options: TrainOptions, described: DescribedModel, world_size: int, microbatches: int | None
) -> str | None:
    problem = _stages_problem(options, described.num_layers, world_size, microbatches)
    if problem is not None:
        return problem
    heads = math.gcd(described.num_heads, described.num_kv_heads)
    if heads % options.tp:
        return (
            f"the model's {described.num_heads} attention / {described.num_kv_heads} key-value heads do not split "
            f"over tp {options.tp}: tp must be one of {_divisors(heads)}"
        )
    # all_to_all scatters each tp rank's attention heads over sp (key/value heads are repeated when fewer); ring_attn
    # splits the sequence and keeps every head, so it puts no rule on them (as cx-shardformer and cx-plan hold)
    per_tp = described.num_heads // options.tp
    if options.sp_mode == "all_to_all" and per_tp % options.sp:
        return (
            f"the model's {described.num_heads} attention heads ({per_tp} per tp rank) do not split over sp "
            f"{options.sp} (--sp-mode all_to_all scatters heads): sp must be one of {_divisors(per_tp)}, or use "
            "--sp-mode ring_attn"
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


def _resume_problem(options: TrainOptions, resume: Path, described: DescribedModel) -> str | None:
    """The checkpoint's model against this run's, tensor by tensor (the model built on the meta device)."""
    bytes_read = options.data is not None and isinstance(described.tokenizer, ByteTokenizer)
    state = read_trainer_state(resume)
    adapters = (resume / "adapter").is_dir()  # models._lora.ADAPTER_FOLDER: a LoRA run's checkpoint
    if adapters != (options.lora is not None):
        return (
            f"--resume {resume}: the checkpoint holds LoRA adapters (adapter/); resume with --lora-rank"
            if adapters
            else f"--resume {resume}: the checkpoint holds the full weights, not LoRA adapters; to fine-tune them "
            f"with LoRA, start a new run with --model {resume / 'model'} --lora-rank N"
        )
    if options.lora is not None and (problem := adapter_problem(resume, options.lora.rank, options.lora.alpha)):
        return problem
    if bytes_read and state.data_epoch is None:  # trained on the embedded text's character ids
        return embedded_text_message(resume, options.model)
    problem = tokenizer_problem(resume, state.tokenizer, tokenizer_identity(described.tokenizer), options.model)
    problem = problem or resumed_run_problem(resume, {"seq_len": options.seq_len, "seed": options.seed})
    if problem is not None:
        return problem
    saved = saved_shapes(resume / "model")
    expected = model_shapes(described) if saved else {}
    flags = {name: getattr(options, name) for name in ("model", "seq_len", "hidden_size", "num_layers")}
    return resumed_model_problem(resume, flags, described.config, saved, expected)


def parse_options(argv: Sequence[str] | None = None, world_size: int | None = None) -> TrainOptions:
    """Parse and validate; `world_size` is the real one under an external torchrun (default: `--nproc`)."""
    return validated_options(parse_arguments(argv), world_size)


def validated_options(args: argparse.Namespace, world_size: int | None = None) -> TrainOptions:
    """`parse_arguments`' values checked together, against the paths, the model and the data (exits 2 on a problem,
    one line under the short usage)."""
    parser = build_parser()
    # an existing path wins over a built-in name, as a local folder does in from_pretrained (and in cx-plan)
    args.model = f"./{args.model}" if args.model in MODEL_CHOICES and Path(args.model).exists() else args.model
    problem = _flag_problem(args) or plugin_switch_problem(args) or training_problem(args) or data_problem(args)
    if problem is not None:
        parser.error(problem)
    if (reporting := reporting_problem(args)) is not None:
        parser.error(reporting)
    if args.save_every < 0 or (args.save_every and args.save is None):
        parser.error("--save-every needs --save DIR and a non-negative step count")
    if args.max_restarts < 0 or (args.max_restarts and args.save is None):
        parser.error("--max-restarts needs --save DIR (a restart resumes from its latest checkpoint) and N >= 0")
    rendezvous = rendezvous_of(args)
    if isinstance(rendezvous, str):
        parser.error(rendezvous)
    problem = None if args.save is None else save_problem(args.save)
    problem = problem or outputs_problem(args.metrics, args.tensorboard, args.data_cache_dir)
    if problem is None and args.resume is not None:
        sizes = {
            "--hidden-size": args.hidden_size or DEFAULT_HIDDEN,
            "--num-layers": args.num_layers or DEFAULT_LAYERS,
        }
        problem = resume_problem(args.resume, args.model, sizes, args.steps, args.optimizer)
    if problem is not None:
        parser.error(problem)
    options = TrainOptions(
        plugin=args.plugin,
        nproc=args.nproc,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        hidden_size=args.hidden_size or DEFAULT_HIDDEN,
        num_layers=args.num_layers or DEFAULT_LAYERS,
        lr=args.lr,
        precision=args.precision,
        seed=args.seed,
        log_every=args.log_every,
        save=args.save,
        save_every=args.save_every,
        max_restarts=args.max_restarts,
        rendezvous=rendezvous,
        resume=args.resume,
        verify=args.verify,
        timeout=args.timeout,
        model=args.model,
        tp=args.tp or 1,
        pp=args.pp or 1,
        ep=args.ep or 1,
        sp=args.sp or 1,
        zero=args.zero or 0,
        microbatches=args.microbatches or args.pp or 1,
        pp_style=args.pp_style or PP_STYLES[0],
        pp_layers=args.pp_layers or PP_LAYER_SPLITS[0],
        data=data_settings(args),
        eval_every=args.eval_every,
        metrics=args.metrics,
        tensorboard=args.tensorboard,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_accum=args.grad_accum,
        clip=args.clip,
        activation_checkpointing=args.activation_checkpointing or args.activation_checkpointing_mode != "full",
        checkpoint_mode=args.activation_checkpointing_mode,
        compile=args.compile,
        compile_backend=args.compile_backend,
        dry_run=args.dry_run,
        switches=plugin_switches(args),
        optimizer=args.optimizer,
        lora=lora_settings(args),
        resolved=tuple(vars(args).items()),
    )
    if world_size is None:  # the launcher: this machine's ranks, times the fewest machines an elastic job runs on
        world_size = options.nproc * (1 if rendezvous is None else rendezvous.min_nodes)
    problem = plugin_missing(options.plugin) or _layout_problem(options, world_size)
    if problem is not None:
        parser.error(problem)
    try:  # the planner's own checks of the combination (the plugin's own run when the ranks build it)
        plan_candidate(options, world_size)
    except ValueError as error:
        parser.error(f"--plugin {options.plugin} cannot run these flags together: {error}")
    try:
        described = describe_model(options.model_spec)
        check_builds(described)
    except ModelError as error:
        parser.error(str(error))
    problem = None if options.resume is None else _resume_problem(options, options.resume, described)
    problem = problem or _model_problem(options, described, world_size, args.microbatches)
    if problem is not None:
        parser.error(problem)
    if options.data is not None:  # tokenised here, once, before any process starts (later runs read the cache)
        global_batch = options.data_parallel_size(world_size) * options.batch_size
        length = options.window_length
        problem = prepared_data_problem(options.data, options.model, options.model_spec.is_folder, length, global_batch)
        if problem is not None:
            parser.error(problem)
    return options
