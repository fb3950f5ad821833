"""Checkpoint-IO machinery the plugins share: the replicated writer every IO builds on, the sharded-optimizer
path, what the Booster asks of an IO, and the adapters for tensor-parallel shards, expert slices and pipeline
stages, with the faces (`ParallelModelView`, `ParallelOptimizerView`) they read."""

from cx_plugins.checkpoint_io._capabilities import KeepsLossScaler, SavesLora
from cx_plugins.checkpoint_io._expert_shards import ExpertParallelShards
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.checkpoint_io._replicated import ReplicatedCheckpointIO, ShardedOptimizerCheckpointIO
from cx_plugins.checkpoint_io._stage_names import StagePlan
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards

__all__ = [
    "ExpertParallelShards",
    "KeepsLossScaler",
    "ParallelModelView",
    "ParallelOptimizerView",
    "ReplicatedCheckpointIO",
    "SavesLora",
    "ShardedOptimizerCheckpointIO",
    "StagePlan",
    "TensorParallelShards",
]
