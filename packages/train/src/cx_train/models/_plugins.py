"""The demo's `--plugin` choices turned into cx plugins (ColossalAI's constructor arguments).

The hybrid plugins are looked up by their public class name in `cx_plugins`: where this cx-plugins does not have one
yet, `--plugin hybrid` / `moe_hybrid` is refused before any process starts (`_options.plugin_missing`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecision

import cx_plugins
from cx_plugins import GeminiPlugin, LowLevelZeroPlugin, Plugin, TorchDDPPlugin, TorchFSDPPlugin
from cx_plugins.demo._options import HYBRID_CLASSES, DemoOptions, plugin_missing
from cx_plugins.fsdp import block_wrap_policy
from cx_shardformer import GradientCheckpointConfig

__all__ = ["hybrid_arguments", "make_plugin"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def hybrid_arguments(options: DemoOptions) -> dict[str, Any]:
    """ColossalAI's HybridParallelPlugin / MoeHybridParallelPlugin keyword arguments for the parallel flags."""
    arguments: dict[str, Any] = dict(
        tp_size=options.tp,
        pp_size=options.pp,
        zero_stage=options.zero,
        precision=options.precision,
        pp_style=options.pp_style,
        num_model_chunks=2 if options.pp_style == "interleaved" else 1,
    )
    if options.pp > 1:
        arguments["num_microbatches"] = options.microbatches
    if options.sp > 1:  # ColossalAI's sp_size applies to the all_to_all mode (Ulysses)
        arguments.update(enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all", sp_size=options.sp)
    if options.plugin == "moe_hybrid":
        arguments["ep_size"] = options.ep
    if options.activation_checkpointing:  # every decoder layer, through ShardFormer's switch
        arguments["gradient_checkpoint_config"] = GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
    return arguments


def make_plugin(options: DemoOptions, model: nn.Module | None = None) -> tuple[Plugin, str | None]:
    """The plugin and the Booster's `mixed_precision` (for the plugins that leave precision to the Booster).
    Given the `model`, torch_fsdp shards each of its decoder layers on its own (`block_wrap_policy`), as torchtitan
    and every FSDP recipe do, so a step gathers a block at a time; without it, one root unit (the whole model)."""
    if options.plugin == "torch_ddp":
        return TorchDDPPlugin(), None if options.precision == "fp32" else options.precision
    if options.plugin == "gemini":
        # The demo model is small: small chunks, so that its parameters really are sharded over the ranks.
        return GeminiPlugin(precision=options.precision, search_range_m=1, min_chunk_size_m=0.05, hidden_dim=64), None
    if options.plugin == "low_level_zero":
        return LowLevelZeroPlugin(stage=options.zero or 2, precision=options.precision), None
    if options.plugin == "torch_fsdp":
        dtype = _DTYPES.get(options.precision)
        policy = None if dtype is None else MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
        wrap = None if model is None else block_wrap_policy(model)
        return TorchFSDPPlugin(mixed_precision=policy, auto_wrap_policy=wrap), None
    if options.plugin in HYBRID_CLASSES:
        missing = plugin_missing(options.plugin)
        if missing is not None:
            raise ValueError(missing)
        plugin: Plugin = getattr(cx_plugins, HYBRID_CLASSES[options.plugin])(**hybrid_arguments(options))
        return plugin, None
    raise ValueError(f"unknown plugin {options.plugin!r}")
