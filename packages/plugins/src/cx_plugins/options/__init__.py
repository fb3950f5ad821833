"""Argument groups the plugins share (DDP's, ShardFormer's) and the boost settings every rank must agree on."""

from cx_plugins.options._ddp import DDPOptions
from cx_plugins.options._settings import BoostSettings, check_boost_settings
from cx_plugins.options._shardformer import ShardFormerOptions

__all__ = ["BoostSettings", "DDPOptions", "ShardFormerOptions", "check_boost_settings"]
