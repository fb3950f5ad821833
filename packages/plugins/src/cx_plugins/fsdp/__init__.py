"""`TorchFSDPPlugin`: FSDP1's arguments over FSDP2 (`fully_shard`), with its options, wrapping and checkpoint IO;
`block_wrap_policy(model)` shards each decoder layer on its own (what cx-train's `--plugin torch_fsdp` uses)."""

from cx_plugins.fsdp._blocks import block_classes, block_wrap_policy, decoder_layers
from cx_plugins.fsdp._plugin import TorchFSDPPlugin

__all__ = ["TorchFSDPPlugin", "block_classes", "block_wrap_policy", "decoder_layers"]
