"""Adapter "this tensor is an expert slice": between a rank's expert-parallel slices and the full expert stacks the
canonical checkpoint holds, composed over the tensor-parallel adapter.

An expert parameter (cx-moe's `is_moe_tensor`, e.g. transformers 5's fused `mlp.experts.gate_up_proj [E, 2I, H]`
and `down_proj [E, H, I]`) holds experts [r * E/ep, (r + 1) * E/ep) of its ep group along dim 0. Saving first
gathers a tensor over the TP group (`TensorParallelShards`, for experts split by `expert_tensor_parallel`), then over
its ep group along dim 0 (every ep rank ends up with the full stack); loading cuts the ep rank's experts from the full
stack, then its TP slice (local). Optimizer state entries shaped like their parameter's slice follow it; scalars and
dense parameters pass through. With ep size 1 (or no experts) this is the TP adapter unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from cx_checkpoint import Region, TensorSink, TensorSpec
from cx_mesh import ProcessGroup, all_gather_flat, communication_device
from cx_moe import get_moe_info
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards, parameter_of_state

__all__ = ["ExpertParallelShards"]


@dataclass(frozen=True)
class _ExpertSplit:
    """One expert parameter: its ep group, this rank's position in it, and its shape full over tp, local over ep."""

    group: ProcessGroup | None
    rank: int
    size: int
    local_shape: tuple[int, ...]

    @property
    def full_shape(self) -> tuple[int, ...]:
        return (self.local_shape[0] * self.size, *self.local_shape[1:])


class ExpertParallelShards:
    """TP shards and expert slices of a model by name: `gather` / `scatter` / `full_spec` / `sink` as
    `TensorParallelShards` offers them, with the ep dimension (dim 0 of an expert stack) handled after tp."""

    def __init__(self, tp: TensorParallelShards, experts: Mapping[str, _ExpertSplit]) -> None:
        self.tp = tp
        self.experts = dict(experts)

    @classmethod
    def of_module(cls, module: nn.Module, tp: TensorParallelShards) -> ExpertParallelShards:
        """Every expert parameter of `module` split over an ep group of size > 1, under all its names."""
        experts: dict[str, _ExpertSplit] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            info = get_moe_info(param)
            if info is None or info.ep_size == 1:
                continue
            split = tp.split.get(name)
            shape = split.full_shape if split is not None else tuple(param.shape)
            if shape[0] * info.ep_size != info.num_experts:
                raise ValueError(
                    f"{name}: an expert slice of {shape[0]} experts on each of {info.ep_size} ep ranks does not make "
                    f"the {info.num_experts} experts its marking names"
                )
            experts[name] = _ExpertSplit(info.ep_group, info.ep_rank, info.ep_size, shape)
        return cls(experts=experts, tp=tp)

    def _split_of(self, name: str, shape: tuple[int, ...], full: bool) -> _ExpertSplit | None:
        owner = parameter_of_state(name)
        split = self.experts.get(owner[0] if owner is not None else name)
        if split is None:
            return None
        return split if shape == (split.full_shape if full else split.local_shape) else None

    # ---- saving ---------------------------------------------------------------------------------------------
    def gather(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The full tensor of a local one: TP gather, then the ep gather of an expert slice (collectives over the
        tp group and the parameter's ep group; every rank of them must call it, in step)."""
        whole_over_tp = self.tp.gather(name, tensor)
        split = self._split_of(name, tuple(whole_over_tp.shape), full=False)
        if split is None:
            return whole_over_tp
        device = communication_device(split.group)
        local = whole_over_tp.detach().to(device).contiguous()
        gathered = torch.empty((split.size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=device)
        all_gather_flat(gathered.view(-1), local.view(-1), split.group)  # ep rank r's experts land at block r
        return gathered

    # ---- loading --------------------------------------------------------------------------------------------
    def scatter(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts, then its TP slice, of a full tensor (local: no communication)."""
        split = self._split_of(name, tuple(full.shape), full=True)
        if split is not None:
            local = split.local_shape[0]
            full = full.narrow(0, split.rank * local, local).contiguous()
        return self.tp.scatter(name, full)

    def full_spec(self, name: str, local: TensorSpec) -> TensorSpec:
        over_tp = self.tp.full_spec(name, local)
        split = self._split_of(name, over_tp.shape, full=False)
        return over_tp if split is None else TensorSpec(split.full_shape, over_tp.dtype)

    def sink(self, inner: TensorSink) -> TensorSink:
        """`inner` (which expects local shapes) fed from full tensors: each rank keeps its experts and TP slice."""
        return _ScatteringSink(self, inner)


class _ScatteringSink:
    def __init__(self, shards: ExpertParallelShards, inner: TensorSink) -> None:
        self._shards = shards
        self._inner = inner
        self._local = dict(inner.expected_tensors())

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        return {name: self._shards.full_spec(name, spec) for name, spec in self._local.items()}

    def owned_region(self, name: str) -> Region | None:
        return None  # read whole, cut locally (as the TP sink does)

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        self._inner.receive(name, self._shards.scatter(name, tensor))
