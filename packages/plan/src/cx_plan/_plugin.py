"""`make_plugin`: a `Candidate` turned into the cx plugin that runs it, the one translation from the planner's terms
to a constructor call. cx-train builds its plugin here from the flags' candidate, cx-plan's `--measure` runs the
candidates it ranks with it, and the benchmarks time them with it, so what is planned is what trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

from cx_plan._candidate import Candidate
from cx_plan.memory._gemini_chunks import GEMINI_HIDDEN_DIM, GEMINI_MIN_CHUNK_SIZE_M, GEMINI_SEARCH_RANGE_M
from cx_plugins import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from cx_plugins.fsdp import block_wrap_policy
from cx_shardformer import GradientCheckpointConfig

__all__ = ["make_plugin"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def make_plugin(
    candidate: Candidate, model: nn.Module | None = None, extra: Mapping[str, Any] | None = None
) -> tuple[Plugin, str | None]:
    """The plugin for `candidate` and the Booster's `mixed_precision` (set only for DDP,
    which leaves precision to the Booster). Per-block FSDP (`fsdp_wrap="block"`) wraps each decoder layer of `model`
    (`fsdp.block_wrap_policy`), so it needs the model; checkpointing a ratio of layers under the hybrid
    plugins goes through ShardFormer (`GradientCheckpointConfig`), while the data-parallel plugins checkpoint the
    model itself before boosting (`enable_activation_checkpointing`). `extra` are further constructor arguments the
    planner does not judge (fp8, fused kernels, ...: cx-train's switches), passed as they are."""
    c, arguments = candidate, {**candidate.plugin_arguments(), **(extra or {})}
    if c.plugin == "torch_ddp":
        return TorchDDPPlugin(**(extra or {})), None if c.precision == "fp32" else c.precision
    if c.plugin == "torch_fsdp":
        if extra:
            raise ValueError(f"TorchFSDPPlugin takes none of {', '.join(extra)} here")
        dtype = _DTYPES.get(c.precision)
        policy = None if dtype is None else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
        if c.fsdp_wrap == "block" and model is None:
            raise ValueError("per-block FSDP wraps the model's decoder layers: make_plugin needs the model")
        wrap = block_wrap_policy(model) if c.fsdp_wrap == "block" and model is not None else None
        return TorchFSDPPlugin(mixed_precision=policy, auto_wrap_policy=wrap), None
    if c.plugin == "low_level_zero":
        return LowLevelZeroPlugin(**arguments), None
    if c.plugin == "gemini":
        # cx's models are small next to the chunk search's defaults: small chunks, so they really are sharded
        # (the memory model lays the chunks out with the same search: memory._gemini_chunks)
        return GeminiPlugin(
            search_range_m=GEMINI_SEARCH_RANGE_M,
            min_chunk_size_m=GEMINI_MIN_CHUNK_SIZE_M,
            hidden_dim=GEMINI_HIDDEN_DIM,
            **arguments,
        ), None
    if c.checkpoint_ratio:
        arguments["gradient_checkpoint_config"] = GradientCheckpointConfig(
            gradient_checkpointing_ratio=c.checkpoint_ratio
        )
    if c.plugin == "moe_hybrid":
        return MoeHybridParallelPlugin(**arguments), None
    return HybridParallelPlugin(**arguments), None
