"""Tensor parallelism under Gemini: ShardFormer over the layout's tp group, before GeminiDDP chunks the model.

Gemini then holds TP shards in its chunks (each split again over the zero group); the TP-split parameters carry
their cx-shardformer `ShardSpec`, which the optimizer's norm (`tp_split_names`) and the checkpoint IO read.
"""

from __future__ import annotations

from torch import nn

from cx_plugins._layout import Axis, ParallelLayout
from cx_plugins._lora import under_adapters
from cx_plugins.options._shardformer import ShardFormerOptions
from cx_shardformer import ShardFormer, get_shard_spec
from cx_shardformer.policies import NoPolicyError

__all__ = ["shard_for_gemini", "tp_split_names"]


def shard_for_gemini(model: nn.Module, options: ShardFormerOptions, layout: ParallelLayout) -> None:
    """Shard `model` in place over the tp group with the plugin's ShardFormer switches (collective over tp).
    GeminiPlugin takes no custom_policy, so a model without a policy is told to register one."""
    try:
        ShardFormer(options.shard_config(layout.group(Axis.TP))).optimize(under_adapters(model))
    except NoPolicyError as error:
        remedy = (
            f"GeminiPlugin takes no custom_policy: register one with cx_shardformer.policies.register_policy("
            f"{error.model_class!r}, factory) before booster.boost"
        )
        raise NoPolicyError(error.model_class, error.known, remedy) from None


def tp_split_names(model: nn.Module) -> list[str]:
    """Names of the parameters split over the tp group (every other parameter is a replica on each TP rank)."""
    return [name for name, param in model.named_parameters() if get_shard_spec(param) is not None]
