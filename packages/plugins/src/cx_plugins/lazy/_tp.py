"""Lazily built models under tensor parallelism: ShardFormer shards the still-meta model (its in-place sharding
gives every split parameter its local shape and `ShardSpec` without touching values), then the construction replay
hands each full parameter over and it is cut at once to this rank's slice, before the next one exists.

`SlicedSource` is the cutting step as a cx-zero `ParameterSource` (Gemini with tp_size > 1 fills its chunks from
it); `materialise_sliced` installs the slices in place (HybridParallelPlugin), skipping the parameters other
pipeline stages hold.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_moe import get_moe_info
from cx_plugins.lazy._context import LazyModel, install_parameter
from cx_shardformer import get_shard_spec, shard_tensor

__all__ = ["SlicedSource", "materialise_sliced"]


class SlicedSource:
    """A `ParameterSource` over a lazily built model that ShardFormer has sharded: each full value is cut to this
    rank's slice of the tensor-parallel `group` (parameters without a `ShardSpec` pass whole)."""

    def __init__(self, lazy: LazyModel, group: ProcessGroup | None) -> None:
        self.lazy = lazy
        self.group = group

    def stream(self, receive: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
        def sliced(param: nn.Parameter, value: torch.Tensor) -> None:
            value = _experts_of_this_rank(param, value)
            spec = get_shard_spec(param)
            receive(param, value if spec is None else shard_tensor(value, spec, self.group))

        self.lazy.stream(sliced)


def _experts_of_this_rank(param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """An expert stack split over ep (cx-moe narrowed the meta parameter in place) takes this rank's experts
    first; a tensor-parallel split of the experts (`expert_tensor_parallel`) then applies to that slice."""
    info = get_moe_info(param)
    if info is None or info.ep_size == 1 or value.shape[0] != info.num_experts:
        return value
    local = info.num_experts // info.ep_size
    return value[info.ep_rank * local : (info.ep_rank + 1) * local]


def materialise_sliced(
    model: nn.Module, lazy: LazyModel, group: ProcessGroup | None, held: set[int] | None = None
) -> None:
    """Give `model`'s parameters their real values, each cut to this rank's tensor-parallel slice as it arrives;
    parameters outside `held` (ids; None: all) belong to other pipeline stages and are dropped unmade."""

    def install(param: nn.Parameter, value: torch.Tensor) -> None:
        if held is None or id(param) in held:
            install_parameter(param, value)

    SlicedSource(lazy, group).stream(install)
    left = [name for name, p in model.named_parameters() if p.is_meta and (held is None or id(p) in held)]
    left += [name for name, b in model.named_buffers() if b.is_meta]
    if left:
        raise ValueError(
            f"LazyInitContext: {left[:5]} are still on the meta device after materialising: ShardFormer replaced "
            "them with new tensors the construction never recorded; build this model without LazyInitContext"
        )
