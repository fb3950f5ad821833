"""What checkpoint IO needs to know about a model split by tensor and pipeline parallelism, and its optimizer.

`ParallelModelView` is the face a boosted hybrid-parallel model shows (HybridParallelModule implements it
structurally): the user's module after ShardFormer (parameter names unchanged, TP shards carrying a cx-shardformer
`ShardSpec`), the plugin's `ParallelLayout`, and the parameter / buffer names this rank's pipeline stage holds.
`ParallelOptimizerView` is the boosted optimizer's face: state by parameter name, each tensor this rank's local TP
shard (full over the data-parallel ranks), in `LowLevelZeroOptimizer.state_dict()`'s layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from torch import nn

from cx_plugins._layout import ParallelLayout

__all__ = ["ParallelModelView", "ParallelOptimizerView"]


@runtime_checkable
class ParallelModelView(Protocol):
    """A model sharded over a `ParallelLayout` (see the module docstring and the issue-15 contract)."""

    layout: ParallelLayout

    def unwrap(self) -> nn.Module:
        """The user's module after ShardFormer (sharded in place; its own / Hugging Face parameter names)."""
        ...

    def held_parameter_names(self) -> frozenset[str]:
        """Names in `unwrap().named_parameters()` whose values this rank's pipeline stage(s) hold (all when pp is
        1); a tied parameter appears on every stage holding it. Parameters of other stages must be skipped."""
        ...

    def held_buffer_names(self) -> frozenset[str]:
        """The same for persistent buffers."""
        ...


@runtime_checkable
class ParallelOptimizerView(Protocol):
    """An optimizer whose state is keyed by parameter name, each tensor this rank's local TP shard."""

    def state_dict_by_name(self) -> dict[str, Any]:
        """`{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}], "grad_scaler": {...}}`
        (collective over the data-parallel group when the state is ZeRO-partitioned)."""
        ...

    def load_state_dict_by_name(self, state_dict: Mapping[str, Any]) -> None:
        """Take the same layout (local TP shards, full over data parallelism); each rank keeps its part."""
        ...
