"""HybridParallelPlugin's options as typed frozen groups, built once from ColossalAI's flat keyword arguments.

`HybridParallelOptions.from_kwargs(...)` is the one place the 47 flat arguments are read; everything after it (the
layout, the model composition, the optimizers) takes a group. Each check raises on every rank before any collective
(every rank runs the same local validation), naming the plugin the user built (`plugin`: HybridParallelPlugin or
MoeHybridParallelPlugin), the argument and the values that would work.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cx_plugins._plugin import ZERO_PRECISIONS
from cx_plugins._precision import Precision
from cx_plugins.options._ddp import DDPOptions
from cx_plugins.options._shardformer import ShardFormerOptions
from cx_shardformer import Policy
from cx_zero import LossScaleOptions

__all__ = [
    "HybridParallelOptions",
    "check_custom_policy",
    "PipelineOptions",
    "PipelineStyle",
    "SequenceParallelism",
    "ZeroOptions",
]


class PipelineStyle(enum.Enum):
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZBV = "zbv"


class SequenceParallelism(enum.Enum):
    """ColossalAI's sequence-parallel modes and where they run.

    `split_gather` and `ring` (Megatron's sequence split, gathered for each column/row pair; ColossalAI's `ring`
    moves the same data with ring send/recv, cx with all-gather/reduce-scatter) use the tensor-parallel group;
    `all_to_all` (Ulysses) and `ring_attn` (ring attention) use the sp axis."""

    NONE = "none"
    SPLIT_GATHER = "split_gather"
    RING = "ring"
    ALL_TO_ALL = "all_to_all"
    RING_ATTN = "ring_attn"

    @property
    def on_sp_axis(self) -> bool:
        return self in (SequenceParallelism.ALL_TO_ALL, SequenceParallelism.RING_ATTN)

    @property
    def shardformer_mode(self) -> str | None:
        """cx-shardformer's name for the mode (its `ring` is ring attention)."""
        return {
            SequenceParallelism.NONE: None,
            SequenceParallelism.SPLIT_GATHER: "split_gather",
            SequenceParallelism.RING: "split_gather",
            SequenceParallelism.ALL_TO_ALL: "all_to_all",
            SequenceParallelism.RING_ATTN: "ring",
        }[self]


@dataclass(frozen=True)
class ZeroOptions:
    """What cx_zero.LowLevelZeroOptimizer receives for zero_stage 1 and 2."""

    stage: int = 0
    bucket_size_in_m: float = 12
    cpu_offload: bool = False
    communication_dtype: torch.dtype | None = None
    overlap_communication: bool = True
    overlap_allgather: bool = False
    fp8_communication: bool = False  # zero_stage 0's gradient all-reduce, or cx-zero's buckets, in fp8
    optimizer_states_dtype: torch.dtype = torch.float32  # Adam's moments in bf16 (cx_zero.Bf16StateAdam) for ZeRO


@dataclass(frozen=True)
class PipelineOptions:
    """The pipeline schedule: style, micro-batching, chunks and layer distribution."""

    style: PipelineStyle = PipelineStyle.ONE_F_ONE_B
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    num_model_chunks: int = 1
    num_layers_per_stage: tuple[int, ...] | None = None
    balance_layers: bool = False  # num_layers_per_stage="balanced": layers split by matmul parameters (cx_pipeline)
    enable_metadata_cache: bool = True
    overlap_p2p: bool = True
    fp8_communication: bool = False  # activations and gradients between stages in fp8


@dataclass(frozen=True)
class HybridParallelOptions:
    """Everything HybridParallelPlugin was given, validated (custom_policy, an object, is kept by the plugin)."""

    tp_size: int
    pp_size: int
    sp_size: int
    sp_mode: SequenceParallelism
    precision: Precision
    max_norm: float
    dp_outside: bool
    shardformer: ShardFormerOptions
    loss_scale: LossScaleOptions
    ddp: DDPOptions
    zero: ZeroOptions
    pipeline: PipelineOptions

    @classmethod
    def build(
        cls,
        *,
        tp_size: int,
        pp_size: int,
        sp_size: int | None,
        precision: str,
        zero_stage: int,
        sequence_parallelism_mode: str | None,
        enable_sequence_parallelism: bool,
        max_norm: float,
        dp_outside: bool,
        shardformer: ShardFormerOptions,
        loss_scale: LossScaleOptions,
        ddp: DDPOptions,
        zero: ZeroOptions,
        pipeline: PipelineOptions,
        plugin: str,
    ) -> HybridParallelOptions:
        """Validate and group the arguments; every error starts with `plugin`, the class the user constructed."""
        for name, value in (("tp_size", tp_size), ("pp_size", pp_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{plugin}: {name} must be a positive integer, got {value!r}")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"{plugin}: zero_stage must be 0, 1 or 2, got {zero_stage!r}")
        if not max_norm >= 0 or math.isinf(max_norm):
            raise ValueError(f"{plugin}: max_norm must be >= 0 (0 disables clipping), got {max_norm}")
        for name, size in (("ddp_bucket_cap_mb", ddp.bucket_cap_mb), ("zero_bucket_size_in_m", zero.bucket_size_in_m)):
            if not size > 0 or math.isinf(size):
                raise ValueError(f"{plugin}: {name} must be a positive number, got {size!r}")
        mode, sp = _sequence_parallelism(
            enable_sequence_parallelism, sequence_parallelism_mode, sp_size, tp_size, plugin
        )
        _check_pipeline(pipeline, pp_size, plugin)
        return cls(
            tp_size=tp_size,
            pp_size=pp_size,
            sp_size=sp,
            sp_mode=mode,
            precision=Precision.parse(precision, ZERO_PRECISIONS),
            max_norm=float(max_norm),
            dp_outside=dp_outside,
            shardformer=shardformer,
            loss_scale=loss_scale,
            ddp=ddp,
            zero=dataclasses.replace(zero, stage=zero_stage),
            pipeline=pipeline,
        )

    def idle_arguments(self) -> dict[str, str]:
        """Arguments given a non-default value that change nothing in this configuration, each with the reason:
        the plugin warns about them instead of ignoring them silently (ColossalAI ignores them without a word)."""
        idle: dict[str, str] = {}
        zero, ddp, pipeline = self.zero, self.ddp, self.pipeline
        if zero.stage == 0:
            given = {
                "zero_bucket_size_in_m": zero.bucket_size_in_m != ZeroOptions.bucket_size_in_m,
                "communication_dtype": zero.communication_dtype is not None,
                "overlap_allgather": zero.overlap_allgather,
            }
            idle |= {name: "a ZeRO option and zero_stage is 0" for name, on in given.items() if on}
        for name in ddp.hints_given():
            idle[name] = "a torch DDP hint; cx reduces gradients itself (once per step at zero_stage 0)"
        if zero.stage > 0 and ddp.bucket_cap_mb != DDPOptions.bucket_cap_mb:
            idle["ddp_bucket_cap_mb"] = f"the zero_stage-0 bucket size and zero_stage is {zero.stage}"
        if self.pp_size == 1:
            given = {
                "num_microbatches": pipeline.num_microbatches is not None,
                "microbatch_size": pipeline.microbatch_size is not None,
                "pp_style": pipeline.style is not PipelineOptions.style,
                "num_model_chunks": pipeline.num_model_chunks != PipelineOptions.num_model_chunks,
                "num_layers_per_stage": pipeline.num_layers_per_stage is not None or pipeline.balance_layers,
                "enable_metadata_cache": pipeline.enable_metadata_cache != PipelineOptions.enable_metadata_cache,
                "overlap_p2p": pipeline.overlap_p2p != PipelineOptions.overlap_p2p,
            }
            idle |= {name: "a pipeline option and pp_size is 1" for name, on in given.items() if on}
        return idle


def _sequence_parallelism(
    enabled: bool, mode: str | None, sp_size: int | None, tp_size: int, plugin: str
) -> tuple[SequenceParallelism, int]:
    if not enabled:
        if mode is not None:
            raise ValueError(f"{plugin}: sequence_parallelism_mode={mode!r} needs enable_sequence_parallelism=True")
        if sp_size not in (None, 1):
            raise ValueError(
                f"{plugin}: sp_size={sp_size} needs enable_sequence_parallelism=True (and the "
                "all_to_all or ring_attn mode)"
            )
        return SequenceParallelism.NONE, 1
    names = [m.value for m in SequenceParallelism if m is not SequenceParallelism.NONE]
    try:
        chosen = SequenceParallelism(mode or "split_gather")
    except ValueError:
        chosen = SequenceParallelism.NONE
    if chosen is SequenceParallelism.NONE:
        raise ValueError(f"{plugin}: unknown sequence_parallelism_mode {mode!r}; accepted: {names}")
    if not chosen.on_sp_axis:
        if tp_size < 2:
            raise ValueError(
                f"{plugin}: sequence_parallelism_mode={chosen.value!r} splits the sequence over the "
                "tensor-parallel group and needs tp_size > 1 (or use 'all_to_all' / 'ring_attn' with sp_size)"
            )
        if sp_size not in (None, 1):
            raise ValueError(
                f"{plugin}: sequence_parallelism_mode={chosen.value!r} runs on the tensor-parallel group; "
                f"sp_size must be 1 or None, got {sp_size}"
            )
        return chosen, 1
    sp = 1 if sp_size is None else sp_size
    if not isinstance(sp, int) or sp < 1:
        raise ValueError(f"{plugin}: sp_size must be a positive integer, got {sp_size!r}")
    return chosen, sp


def _check_pipeline(pipeline: PipelineOptions, pp_size: int, plugin: str) -> None:
    style, chunks = pipeline.style, pipeline.num_model_chunks
    if pp_size == 1:
        return
    if pipeline.num_microbatches is None and pipeline.microbatch_size is None:
        raise ValueError(f"{plugin}: pipeline parallelism (pp_size > 1) needs num_microbatches or microbatch_size")
    for name in ("num_microbatches", "microbatch_size"):
        value = getattr(pipeline, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{plugin}: {name} must be a positive integer, got {value!r}")
    if style is PipelineStyle.ONE_F_ONE_B and chunks != 1:
        raise ValueError(f"{plugin}: pp_style='1f1b' holds one chunk per stage; num_model_chunks={chunks}")
    if style is PipelineStyle.INTERLEAVED and chunks < 2:
        raise ValueError(f"{plugin}: pp_style='interleaved' needs num_model_chunks >= 2, got {chunks}")
    if style is PipelineStyle.ZBV and chunks != 2:
        raise ValueError(f"{plugin}: pp_style='zbv' needs num_model_chunks=2 (the V), got {chunks}")


def parse_layers_per_stage(value: Sequence[int] | str | None, plugin: str) -> tuple[tuple[int, ...] | None, bool]:
    """`num_layers_per_stage`: counts per virtual stage, None (an even split) or "balanced" (by cost); returns the
    counts and whether to balance."""
    if isinstance(value, str):
        if value != "balanced":
            raise ValueError(
                f"{plugin}: num_layers_per_stage takes a list of layer counts, None (even) or 'balanced' (by each "
                f"stage's matmul parameters, the head included), got {value!r}"
            )
        return None, True
    return (None if value is None else tuple(value)), False


def parse_pipeline_style(value: str, plugin: str) -> PipelineStyle:
    try:
        return PipelineStyle(value)
    except ValueError:
        raise ValueError(
            f"{plugin}: unknown pp_style {value!r}; accepted: {[s.value for s in PipelineStyle]}"
        ) from None


def check_custom_policy(policy: object, plugin: str) -> Policy | None:
    """`custom_policy` must be None or a cx_shardformer `Policy` instance: a name or a class fails here, naming both,
    instead of deep in the sharder at boost."""
    if policy is None or isinstance(policy, Policy):
        return policy
    if isinstance(policy, type) and issubclass(policy, Policy):
        raise TypeError(
            f"{plugin}: custom_policy must be a Policy instance, got the class {policy.__name__}; pass "
            f"custom_policy={policy.__name__}()"
        )
    raise TypeError(
        f"{plugin}: custom_policy must be a cx_shardformer Policy instance (e.g. cx_shardformer.policies."
        f"LlamaForCausalLMPolicy()) or None, got {type(policy).__name__} {reprlib.repr(policy)}"
    )
