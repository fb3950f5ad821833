"""`TorchFSDPPlugin`: FSDP1's arguments over FSDP2 (`fully_shard`), with its options, wrapping and checkpoint IO."""

from cx_plugins.fsdp._plugin import TorchFSDPPlugin

__all__ = ["TorchFSDPPlugin"]
