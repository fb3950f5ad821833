"""`ShardFormer(shard_config).optimize(model, policy=None) -> (model, shared_params)`, as in ColossalAI."""

from __future__ import annotations

from torch import nn

from cx_shardformer._config import ShardConfig
from cx_shardformer._policy import Policy
from cx_shardformer._sharder import ModelSharder

__all__ = ["ShardFormer"]


class ShardFormer:
    """Shards a model in place under a policy (chosen by model class when not given)."""

    def __init__(self, shard_config: ShardConfig) -> None:
        if not isinstance(shard_config, ShardConfig):
            raise TypeError(f"ShardFormer expects a ShardConfig, got {type(shard_config).__name__}")
        self.shard_config = shard_config

    def optimize(
        self, model: nn.Module, policy: Policy | None = None
    ) -> tuple[nn.Module, list[dict[int, nn.Parameter]]]:
        """Apply `policy` (or the auto-selected one) to `model`; returns the model and the parameters shared between
        pipeline stages (empty: no pipeline here). Parameters keep their identity (sharded in place)."""
        if policy is None:
            from cx_shardformer.policies import get_autopolicy

            policy = get_autopolicy(model)
        sharder = ModelSharder(model, policy, self.shard_config)
        shared = sharder.shard()
        return sharder.model, shared
