"""`ShardFormer(shard_config).optimize(model, policy=None) -> (model, shared_params)`, as in ColossalAI."""

from __future__ import annotations

from dataclasses import fields

import torch.distributed as dist
from torch import nn

from cx_mesh import assert_same_across_ranks
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
        self._check_agreement(model, policy)
        sharder = ModelSharder(model, policy, self.shard_config)
        shared = sharder.shard()
        return sharder.model, shared

    def _check_agreement(self, model: nn.Module, policy: Policy) -> None:
        """Every rank of the tensor- and sequence-parallel groups must shard the same model the same way: a rank
        with another setting fails here, naming the field, instead of hanging in a later collective."""
        config = self.shard_config
        summary = {
            "model": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "policy": type(policy).__name__,
            **{f.name: getattr(config, f.name) for f in fields(config) if not f.name.endswith(("group", "manager"))},
        }
        groups = [config.tensor_parallel_process_group] if config.enable_tensor_parallelism else []
        if config.enable_sequence_parallelism and config.sp_group is not config.tensor_parallel_process_group:
            groups.append(config.sp_group)
        for group in groups:
            summary["group ranks"] = dist.get_process_group_ranks(group) if group is not None else "world"
            assert_same_across_ranks(summary, group=group, what="ShardFormer settings")
