"""Sequence parallelism for the Hugging Face decoder policies (filled in below)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cx_shardformer.policies._common import HFDecoderPolicy

__all__ = ["apply_sequence_parallelism", "check_sequence_parallelism"]


def check_sequence_parallelism(policy: HFDecoderPolicy) -> None:
    if policy.shard_config.enable_sequence_parallelism:
        raise NotImplementedError("sequence parallelism: not yet")


def apply_sequence_parallelism(policy: HFDecoderPolicy) -> None:
    return None
