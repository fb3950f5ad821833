"""What the policy helpers (`_dropout`, `_moe_sequence`, `_overlap`, `_sequence`) read from a decoder policy.

A leaf module: `HFDecoderPolicy` (`_common`) satisfies `DecoderPolicy` structurally, so the helpers type their
argument without importing `_common`, which imports them back.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from cx_shardformer._config import ShardConfig

__all__ = ["DecoderPolicy"]


class DecoderPolicy(Protocol):
    """The parts of `HFDecoderPolicy` that the helpers use (read-only)."""

    @property
    def model(self) -> nn.Module: ...

    @property
    def shard_config(self) -> ShardConfig: ...

    @property
    def hf_config(self) -> Any: ...

    @property
    def norm_path(self) -> str: ...

    @property
    def attention_name(self) -> str: ...

    @property
    def mlp_name(self) -> str: ...

    @property
    def shares_block_reductions(self) -> bool: ...

    @property
    def attention_probability_dropouts(self) -> tuple[str, ...]: ...

    def decoder_layers(self) -> list[nn.Module]: ...

    def sequence_gathered_blocks(self, layer: nn.Module) -> tuple[str, ...]: ...
