"""`Candidate`: one training configuration the planner judges (plugin, parallel sizes, micro-batching, activation
checkpointing, Gemini placement, precision, the optimizer and Adam's state dtype), in ColossalAI's terms.

Frozen and validated on construction, so the memory model, the step-time model and a measurement harness all read
the same facts; an impossible combination raises `ValueError` naming the field. Sizes follow the plugins' meshes:
the world is dp x pp x tp x sp, where `sp` is the sequence-parallel axis (only `all_to_all` / `ring_attn` use one;
`split_gather` / `ring` split the sequence over the tp group), and under MoeHybrid the dp ranks are moe_dp x ep.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "PIPELINE_STYLES",
    "BLOCK_POLICY",
    "CHECKPOINT_MODES",
    "FSDP_WRAPS",
    "OPTIMIZERS",
    "OPTIMIZER_STATES_DTYPES",
    "PLACEMENT_POLICIES",
    "PLUGINS",
    "PRECISIONS",
    "SP_MODES",
    "Candidate",
    "CodeText",
    "Optimizer",
]

PLUGINS = ("torch_ddp", "torch_fsdp", "low_level_zero", "gemini", "hybrid", "moe_hybrid")
PRECISIONS = ("fp32", "fp16", "bf16")
PIPELINE_STYLES = ("1f1b", "interleaved", "zbv")
SP_MODES = ("split_gather", "ring", "all_to_all", "ring_attn")
PLACEMENT_POLICIES = ("static", "auto")
CHECKPOINT_MODES = ("full", "selective-op")  # how a checkpointed layer recomputes: all of it, or torchtitan's op policy
FSDP_WRAPS = ("model", "block")  # TorchFSDPPlugin: one root unit, or each decoder layer its own fully_shard
# the argument TorchFSDPPlugin takes for per-block wrapping, as printed (the class is the model's decoder layer)
BLOCK_POLICY = "ModuleWrapPolicy({DecoderLayer})"
OPTIMIZER_STATES_DTYPES = ("fp32", "bf16")  # Adam's moments: the ZeRO plugins' optimizer_states_dtype


class Optimizer(StrEnum):
    """cx-train's `--optimizer` as the planner counts it: torch's AdamW (two moments per element; cx-zero's fused
    Adam(W)s hold the same), or cx-zero's MuonWithAdamW (one momentum per hidden matrix element, AdamW's two moments
    on 1-D parameters, embeddings and the output head; every parameter stepped whole on one owner rank)."""

    ADAMW = "adamw"
    MUON = "muon"


OPTIMIZERS = tuple(str(o) for o in Optimizer)
_SP_AXIS_MODES = ("all_to_all", "ring_attn")
_PARALLEL_PLUGINS = ("hybrid", "moe_hybrid")
# the ZeRO stage each plugin runs: DDP replicates, FSDP (full shard) and Gemini shard everything
_FIXED_STAGE = {"torch_ddp": 0, "torch_fsdp": 3, "gemini": 3}
_STAGES = {"low_level_zero": (1, 2), "hybrid": (0, 1, 2), "moe_hybrid": (0, 1, 2)}
# GeminiPlugin's tp_size: ShardFormer splits the model over tp, Gemini chunks each tp rank's part over dp; no pp, no
# sequence parallelism (cx-train has no flags for GeminiPlugin's)


class CodeText(str):
    """An argument value printed as code (its repr is its text), e.g. the FSDP wrap policy of a constructor call."""

    def __repr__(self) -> str:
        return str(self)


def _optimizer(value: object) -> Optimizer:
    if isinstance(value, Optimizer):
        return value
    _require(value in OPTIMIZERS, f"unknown optimizer {value!r}; one of {', '.join(OPTIMIZERS)}")
    return Optimizer(str(value))


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"Candidate: {message}")


@dataclass(frozen=True)
class Candidate:
    """One configuration: which plugin, how the world splits, how a step is batched, what is recomputed."""

    plugin: str
    dp: int = 1  # data-parallel ranks (under moe_hybrid: moe_dp x ep)
    tp: int = 1
    pp: int = 1
    sp: int = 1  # the sequence-parallel axis size (all_to_all / ring_attn); 1 otherwise
    sp_mode: str | None = None
    ep: int = 1
    zero_stage: int | None = None  # None: the plugin's own (DDP 0, FSDP / Gemini 3, LowLevelZero 2, hybrid 0)
    micro_batch_size: int = 1
    num_microbatches: int = 1  # per step and dp rank: pipeline micro-batches (pp > 1) or accumulation steps
    pp_style: str = "1f1b"
    checkpoint_ratio: float = 0.0  # fraction of decoder layers whose activations are recomputed
    checkpoint_mode: str = "full"  # "selective-op": those layers keep torchtitan's op policy's outputs (ratio 1 only)
    placement_policy: str = "static"  # Gemini
    offload_optim_frac: float = 0.0  # Gemini: fraction of optimizer states on the CPU
    offload_param_frac: float = 0.0  # Gemini: fraction of fp32 master weights on the CPU
    cpu_offload: bool = False  # LowLevelZero / hybrid ZeRO: optimizer states on the CPU
    precision: str = "bf16"
    fsdp_wrap: str = "model"  # torch_fsdp: "model" (one root unit, ColossalAI's default) or "block" (per layer)
    optimizer_states_dtype: str = "fp32"  # ZeRO plugins: "bf16" keeps Adam's moments in bf16 (2 + 2 bytes)
    # the hottest routed expert's tokens over the mean expert's (1: balanced); the planner predicts the worst ep
    # rank's memory and time (trace._oracle's Routing); no effect without expert parallelism
    routing_skew: float = 1.0
    optimizer: Optimizer = Optimizer.ADAMW

    def __post_init__(self) -> None:
        _require(self.plugin in PLUGINS, f"unknown plugin {self.plugin!r}; one of {', '.join(PLUGINS)}")
        _require(self.precision in PRECISIONS, f"unknown precision {self.precision!r}; one of {', '.join(PRECISIONS)}")
        for name in ("dp", "tp", "pp", "sp", "ep", "micro_batch_size", "num_microbatches"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{name} must be a positive integer, got {value!r}")
        _require(
            isinstance(self.routing_skew, int | float) and self.routing_skew >= 1,
            f"routing_skew must be a number >= 1 (the hottest expert's tokens over the mean expert's; 1 is balanced), "
            f"got {self.routing_skew!r}",
        )
        parallel = self.plugin in _PARALLEL_PLUGINS
        if self.plugin == "gemini":
            _require(
                (self.pp, self.sp, self.ep) == (1, 1, 1) and self.sp_mode is None,
                "gemini runs data parallelism, with tensor parallelism (tp_size) at most: pp, sp, ep must be 1 and "
                "sp_mode None",
            )
        elif not parallel:
            _require(
                (self.tp, self.pp, self.sp, self.ep) == (1, 1, 1, 1) and self.sp_mode is None,
                f"{self.plugin} runs data parallelism only: tp, pp, sp, ep must be 1 and sp_mode None",
            )
        _require(self.ep == 1 or self.plugin == "moe_hybrid", "ep > 1 needs the moe_hybrid plugin")
        _require(
            self.dp % self.ep == 0, f"moe_hybrid splits dp={self.dp} into moe_dp x ep: ep={self.ep} must divide it"
        )
        _require(self.sp_mode is None or self.sp_mode in SP_MODES, f"unknown sp_mode {self.sp_mode!r}")
        _require(
            self.sp == 1 or self.sp_mode in _SP_AXIS_MODES,
            f"sp={self.sp} needs sp_mode all_to_all or ring_attn (split_gather / ring split over the tp group)",
        )
        _require(
            self.sp_mode not in ("split_gather", "ring") or self.tp > 1,
            f"sp_mode {self.sp_mode} splits the sequence over the tp group: it needs tp > 1",
        )
        _require(self.pp_style in PIPELINE_STYLES, f"unknown pp_style {self.pp_style!r}")
        _require(self.pp > 1 or self.pp_style == "1f1b", f"pp_style {self.pp_style} needs pp > 1")
        _require(  # cx-pipeline's interleaved order; 1F1B and ZBV run any count (fewer than pp: mostly bubble)
            self.pp_style != "interleaved" or self.num_microbatches % self.pp == 0,
            f"pp_style interleaved needs num_microbatches a multiple of pp={self.pp}, got {self.num_microbatches}",
        )
        stage = self.stage
        allowed = _STAGES.get(self.plugin, (_FIXED_STAGE.get(self.plugin),))
        _require(stage in allowed, f"{self.plugin} runs ZeRO stage {' or '.join(map(str, allowed))}, not {stage}")
        _require(0.0 <= self.checkpoint_ratio <= 1.0, f"checkpoint_ratio {self.checkpoint_ratio} is not in [0, 1]")
        _require(
            parallel or self.checkpoint_ratio in (0.0, 1.0),
            f"{self.plugin} checkpoints the whole model or nothing (transformers' switch), not a ratio of "
            f"{self.checkpoint_ratio}: use 0 or 1 (a ratio of layers needs hybrid or moe_hybrid)",
        )
        _require(
            self.plugin != "gemini" or self.num_microbatches == 1,
            f"gemini runs one micro-batch per step (GeminiDDP refuses gradient accumulation without "
            f"enable_gradient_accumulation, and cx-train refuses --grad-accum with it), not {self.num_microbatches}",
        )
        _require(
            self.checkpoint_mode in CHECKPOINT_MODES,
            f"unknown checkpoint_mode {self.checkpoint_mode!r}; one of {', '.join(CHECKPOINT_MODES)}",
        )
        _require(
            self.checkpoint_mode == "full" or (self.checkpoint_ratio == 1.0 and not parallel),
            f"checkpoint_mode {self.checkpoint_mode} checkpoints every layer (checkpoint_ratio 1, not "
            f"{self.checkpoint_ratio:g}) through transformers' switch; {self.plugin} "
            + ("checkpoints through ShardFormer's policies, a ratio of whole layers only" if parallel else "can"),
        )
        _require(
            self.checkpoint_mode == "full" or self.plugin != "gemini" or self.tp == 1,
            f"checkpoint_mode {self.checkpoint_mode} under gemini at tp={self.tp}: nothing runs torchtitan's op policy "
            "around ShardFormer's tp layers (cx-train refuses it, as for hybrid); use checkpoint_mode full",
        )
        _require(self.placement_policy in PLACEMENT_POLICIES, f"unknown placement_policy {self.placement_policy!r}")
        for name in ("offload_optim_frac", "offload_param_frac"):
            value = getattr(self, name)
            _require(0.0 <= value <= 1.0, f"{name} {value} is not in [0, 1]")
            _require(value == 0.0 or self.plugin == "gemini", f"{name} is a GeminiPlugin setting")
        _require(not self.cpu_offload or stage in (1, 2), "cpu_offload offloads ZeRO stage 1/2 optimizer states")
        _require(self.fsdp_wrap in FSDP_WRAPS, f"unknown fsdp_wrap {self.fsdp_wrap!r}; one of {', '.join(FSDP_WRAPS)}")
        _require(
            self.fsdp_wrap == "model" or self.plugin == "torch_fsdp",
            f"fsdp_wrap {self.fsdp_wrap!r} is a TorchFSDPPlugin setting, not {self.plugin}'s",
        )
        _require(
            self.optimizer_states_dtype in OPTIMIZER_STATES_DTYPES,
            f"unknown optimizer_states_dtype {self.optimizer_states_dtype!r}; one of "
            f"{', '.join(OPTIMIZER_STATES_DTYPES)}",
        )
        _require(
            self.optimizer_states_dtype == "fp32" or self.plugin in ("low_level_zero", "gemini", *_PARALLEL_PLUGINS),
            f"optimizer_states_dtype {self.optimizer_states_dtype!r} is a ZeRO setting (low_level_zero, gemini, "
            f"hybrid / moe_hybrid with zero_stage 1 or 2), not {self.plugin}'s",
        )
        _require(
            self.optimizer_states_dtype == "fp32" or stage >= 1,
            f"optimizer_states_dtype {self.optimizer_states_dtype!r} is ZeRO's: {self.plugin} needs zero_stage 1 or 2",
        )
        object.__setattr__(self, "optimizer", _optimizer(self.optimizer))  # a JSON plan's plain name: the enum
        _require(
            self.optimizer is Optimizer.ADAMW or self.optimizer_states_dtype == "fp32",
            "optimizer_states_dtype bf16 stores Adam's moments with stochastic rounding; optimizer muon keeps fp32 "
            "states (as cx-train refuses the pair)",
        )

    @property
    def stage(self) -> int:
        """The ZeRO stage that runs (the plugin's default when `zero_stage` is None)."""
        if self.zero_stage is not None:
            return self.zero_stage
        return _FIXED_STAGE.get(self.plugin, 2 if self.plugin == "low_level_zero" else 0)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp * self.sp

    @property
    def moe_dp(self) -> int:
        """Ranks holding the same experts (ColossalAI's moe_dp_size); the dense dp under other plugins."""
        return self.dp // self.ep

    @property
    def sequence_split(self) -> int:
        """How many ways one sequence's activations are split between attention blocks."""
        if self.sp_mode in ("split_gather", "ring"):
            return self.tp
        return self.sp

    @property
    def num_model_chunks(self) -> int:
        return 1 if self.pp_style == "1f1b" else 2

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.dp * self.micro_batch_size * self.num_microbatches

    @property
    def half_precision(self) -> bool:
        return self.precision != "fp32"

    @property
    def moment_bytes(self) -> int:
        """Bytes of Adam's two moments per parameter element: 4 + 4, or 2 + 2 with bf16 states."""
        return 2 * (2 if self.optimizer_states_dtype == "bf16" else 4)

    @property
    def muon(self) -> bool:
        return self.optimizer is Optimizer.MUON

    def plugin_arguments(self) -> dict[str, Any]:
        """The plugin constructor's keyword arguments (ColossalAI's names) for this configuration."""
        arguments: dict[str, Any] = {}
        if self.plugin == "torch_fsdp" and self.fsdp_wrap == "block":
            arguments = dict(auto_wrap_policy=CodeText(BLOCK_POLICY))
        elif self.plugin == "gemini":
            arguments = dict(placement_policy=self.placement_policy, precision=self.precision)
            if self.tp > 1:
                arguments["tp_size"] = self.tp
            if self.offload_optim_frac or self.offload_param_frac:
                arguments.update(offload_optim_frac=self.offload_optim_frac, offload_param_frac=self.offload_param_frac)
        elif self.plugin == "low_level_zero":
            arguments = dict(stage=self.stage, precision=self.precision)
            if self.cpu_offload:
                arguments["cpu_offload"] = True
        elif self.plugin in _PARALLEL_PLUGINS:
            arguments = dict(tp_size=self.tp, pp_size=self.pp, zero_stage=self.stage, precision=self.precision)
            if self.plugin == "moe_hybrid":
                arguments["ep_size"] = self.ep
            if self.pp > 1:
                arguments.update(
                    num_microbatches=self.num_microbatches,
                    pp_style=self.pp_style,
                    num_model_chunks=self.num_model_chunks,
                )
            if self.sp_mode is not None:
                arguments.update(enable_sequence_parallelism=True, sequence_parallelism_mode=self.sp_mode)
                if self.sp > 1:
                    arguments["sp_size"] = self.sp
            if self.cpu_offload:
                arguments["cpu_offload"] = True
        if self.optimizer_states_dtype != "fp32":
            arguments["optimizer_states_dtype"] = self.optimizer_states_dtype
        return arguments

    def label(self) -> str:
        """A short row label that names everything two candidates may differ in, e.g.
        `hybrid dp2 tp2 pp2 1f1b split_gather zero1 mb1x4 ckpt1 bf16` or `torch_fsdp dp8 per-block mb2x1 ckpt-op bf16`
        (Gemini's placement and offload are added by the report's `row_label`)."""
        sizes = "".join(
            f" {name}{getattr(self, name)}" for name in ("dp", "tp", "pp", "sp", "ep") if getattr(self, name) > 1
        )
        sizes += f" {self.pp_style}" if self.pp > 1 else ""  # and the schedule, so that no two rows read alike
        sizes += f" {self.sp_mode}" if self.sp_mode is not None else ""
        zero = f" zero{self.stage}" if self.plugin in ("low_level_zero", *_PARALLEL_PLUGINS) else ""
        zero += " per-block" if self.fsdp_wrap == "block" else ""
        ckpt = f" ckpt{self.checkpoint_ratio:g}" if self.checkpoint_ratio else ""
        ckpt = " ckpt-op" if self.checkpoint_mode == "selective-op" else ckpt
        states = " bf16-states" if self.optimizer_states_dtype == "bf16" else ""
        states += " muon" if self.muon else ""
        return (
            f"{self.plugin}{sizes}{zero} mb{self.micro_batch_size}x{self.num_microbatches}{ckpt} {self.precision}"
            f"{states}"
        )
