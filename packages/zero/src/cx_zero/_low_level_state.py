"""`LowLevelZeroOptimizer`'s checkpoint side: maps between working parameters and master shards, state dicts.

A mixin so that `_low_level_optimizer` keeps to partitioning, reducing and stepping. State dicts hold full states by
parameter name (`_state_dict` streams and re-shards them), so they load at any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup
from cx_zero._bf16_states import Bf16StateAdam
from cx_zero._grad_scaler import BaseGradScaler
from cx_zero._local import is_alias
from cx_zero._options import LowLevelZeroOptions
from cx_zero._partition import ParamShard, shard_of
from cx_zero._state_dict import sharded_optimizer_state, state_bytes, stream_full_states
from cx_zero._whole_state import stream_whole_states, whole_optimizer_state
from cx_zero._whole_step import WholeTensorStep

__all__ = ["LowLevelStateMixin"]

_MIB = 1024 * 1024


class LowLevelStateMixin:
    """The parameter maps, `update_master_params`, state dicts and `local_state_bytes` of `LowLevelZeroOptimizer`,
    which sets the attributes declared here."""

    optim: torch.optim.Optimizer
    options: LowLevelZeroOptions
    _bf16_states: Bf16StateAdam | None
    grad_scaler: BaseGradScaler
    _shards: list[ParamShard]
    _shard_of: dict[int, ParamShard]
    _groups: list[ProcessGroup | None]
    _working_dtype: torch.dtype
    _master_dtype: torch.dtype
    _whole: WholeTensorStep | None
    _shard_of_optimizer_param: dict[int, ParamShard]  # id(tensor in the optimizer's param groups) -> its shard
    synchronize_working_params: Callable[[], None]  # finishes the deferred all-gathers (overlap_allgather)

    # ---- maps -----------------------------------------------------------------------------------------------
    def get_working_to_master_map(self) -> dict[int, torch.Tensor]:
        """id(working parameter) -> this rank's master shard."""
        return {id(s.working): s.master for s in self._shards}

    def get_master_to_working_map(self) -> dict[int, nn.Parameter]:
        """id(master shard) -> working parameter."""
        return {id(s.master): s.working for s in self._shards}

    def owned_whole_masters(self) -> dict[int, torch.Tensor]:
        """A whole-tensor optimizer's (`_whole_step`): id(working parameter) -> the whole master this rank steps, the
        tensor in the optimizer's param groups, for the parameters it owns; empty for an elementwise optimizer. For a
        caller that steps those masters further (HybridParallelPlugin gathers tp slices of them)."""
        if self._whole is None:
            return {}
        return {id(s.working): self._whole.whole[id(s)] for s in self._shards if self._whole.owns(s)}

    def get_param_padding_map(self) -> dict[int, int]:
        """id(working parameter) -> zeros appended before splitting it over its group."""
        return {id(s.working): s.padding for s in self._shards}

    def update_master_params(self, model: nn.Module) -> None:
        """Copy the (e.g. freshly loaded) working parameters of `model` into this rank's master shards."""
        self.synchronize_working_params()
        with torch.no_grad():
            for param in model.parameters():
                shard = self._shard_of.get(id(param))
                if shard is not None and not is_alias(shard):  # a master that is the parameter is up to date
                    piece = shard_of(param.detach(), shard.group_size, shard.group_rank)
                    shard.master.copy_(piece.to(device=shard.master.device, dtype=shard.master.dtype))
        if self._whole is not None:
            self._whole.load_whole_masters()

    # ---- state dicts ----------------------------------------------------------------------------------------
    def _masters_not_working(self) -> bool:
        """Whether the working weights are a rounding of the masters, so a checkpoint must hold the masters for an
        exact resume: mixed precision, or fp8 communication (the working weights are the E4M3 all-gather of fp32
        masters). A group of one replica gathers nothing, but saving its master costs only bytes."""
        return self._master_dtype != self._working_dtype or self.options.fp8_communication

    def _shard_groups(self) -> list[list[ParamShard]]:
        return [[self._shard_of_optimizer_param[id(p)] for p in group["params"]] for group in self.optim.param_groups]

    def state_shard(
        self, prefix: str = "", max_shard_size: float = 1024, only_rank_0: bool = False
    ) -> Iterator[tuple[dict[str, dict[str, Any]], int]]:
        """Yield (full states by `prefix + name`, bytes) pieces of at most `max_shard_size` MiB.

        Collective: every rank must iterate it to the end. With `only_rank_0`, other ranks yield nothing.
        """
        if max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive number of MiB, got {max_shard_size}")
        self.synchronize_working_params()
        keep = not only_rank_0 or dist.get_rank() == 0
        shards = [s for group in self._shard_groups() for s in group]
        limit = int(max_shard_size * _MIB)
        include_master = self._masters_not_working()
        if self._whole is not None:  # each state whole on its owner, an elementwise group's sliced (`_whole_state`)
            yield from stream_whole_states(
                shards, self.optim, self._whole, self._groups, prefix, limit, keep, include_master
            )
            return
        yield from stream_full_states(shards, self.optim, self._groups, prefix, limit, keep, include_master)

    def state_dict(self) -> dict[str, Any]:
        """Full optimizer state by parameter name, plus param groups and the loss scaler (collective)."""
        state: dict[str, dict[str, Any]] = {}
        for piece, _ in self.state_shard(max_shard_size=1 << 40):
            state.update(piece)
        return {
            "state": state,
            "param_groups": self.param_groups_by_name(),
            "grad_scaler": self.grad_scaler.state_dict(),
        }

    def param_groups_by_name(self) -> list[dict[str, Any]]:
        """Each param group's hyper-parameters with `params` as parameter names (local: no communication)."""
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [s.key for s in shards]}
            for group, shards in zip(self.optim.param_groups, self._shard_groups(), strict=True)
        ]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a full state dict (by name, from any world size); each rank keeps its slices."""
        self.synchronize_working_params()
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise KeyError(f"optimizer state dict needs a {key!r} entry, got {sorted(state_dict)}")
        if self._whole is not None:
            self._load_whole_state(state_dict, self._whole)
        else:
            inner, masters = sharded_optimizer_state(state_dict, self._shard_groups())
            self.optim.load_state_dict(inner)
            if self._bf16_states is not None:  # torch casts loaded moments to the parameter's dtype (fp32)
                self._bf16_states.to_bf16()
            with torch.no_grad():
                for shard in self._shards:
                    master = masters.get(id(shard))
                    if master is not None:
                        shard.master.copy_(master.to(device=shard.master.device, dtype=shard.master.dtype))
        if "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(dict(state_dict["grad_scaler"]))

    def _load_whole_state(self, state_dict: Mapping[str, Any], whole: WholeTensorStep) -> None:
        """A whole-tensor optimizer's load: states to their owners (an elementwise group's sliced to every rank),
        full masters to the owners' whole masters and sliced to every master shard (`_whole_state`)."""
        inner, masters = whole_optimizer_state(state_dict, self._shard_groups(), whole)
        self.optim.load_state_dict(inner)
        with torch.no_grad():
            for shard in self._shards:
                master = masters.get(id(shard))
                if master is None:
                    continue
                piece = shard_of(master.detach(), shard.group_size, shard.group_rank)
                shard.master.copy_(piece.to(device=shard.master.device, dtype=shard.master.dtype))
                if shard.group_size > 1 and whole.owns(shard):
                    whole.whole[id(shard)].copy_(master.view(shard.working.shape).to(shard.master.dtype))

    def local_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for master shards and optimizer state (for memory accounting); a master that is the
        working parameter itself (one replica, same dtype) holds none of its own."""
        masters = sum(s.master.numel() * s.master.element_size() for s in self._shards if not is_alias(s))
        if self._whole is not None:
            masters += self._whole.master_bytes()
        state = sum(state_bytes(dict(v)) for v in self.optim.state.values())
        return {"master": masters, "optimizer_state": state}
