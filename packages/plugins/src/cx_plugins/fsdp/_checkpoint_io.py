"""Checkpoint IO for TorchFSDPPlugin, in the canonical cx format (full tensors by parameter name, optimizer state
by name, safetensors + JSON), so FSDP checkpoints load under every cx plugin and any world size, and back.

Saving gathers with torch's own state-dict machinery (`get_model_state_dict` / `get_optimizer_state_dict` with
full state dicts offloaded to the CPU of rank 0: one full copy, on the writing rank only); the master rank writes.
Loading the model reads, on every rank, only the region of each tensor its FSDP shard holds (`DTensorModuleSink`).
Loading the optimizer reads the full state on every rank and lets `set_optimizer_state_dict` keep each rank's shard
(every rank reading the same files also means every rank raises the same error for a bad checkpoint, never a hang).
torch's state-dict functions may step the optimizer once at lr 0 to create its state; torch's Muon and cx-zero's
MuonWithAdamW do so through their `ShardedMuon` (fsdp/_muon.py, fsdp/_muon_adamw.py), as in training. Their states
(Muon's momentum, AdamW's moments) are sharded like their parameters, AdamW's `step` a plain scalar, so they save and
load as any FSDP optimizer's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from cx_checkpoint import DTensorModuleSink, TensorSink, require_names
from cx_plugins.checkpoint_io._replicated import ReplicatedCheckpointIO, _plain
from cx_plugins.checkpoint_io._state_parts import zero_state_from_parts, zero_state_to_parts
from cx_plugins.fsdp._muon import ShardedMuon

__all__ = ["FSDPCheckpointIO"]

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)


class _GatheredView(nn.Module):
    """A model's gathered full state (held by the master rank) presented as a module to the writers."""

    def __init__(self, state: Mapping[str, Any], model: nn.Module) -> None:
        super().__init__()
        self._state = state
        self.config = getattr(model, "config", None)
        self.generation_config = getattr(model, "generation_config", None)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self._state)


class FSDPCheckpointIO(ReplicatedCheckpointIO):
    """Model and optimizer checkpoints of an FSDP2-sharded model (see the module docstring)."""

    def __init__(
        self,
        optimizer_owner: MutableMapping[torch.optim.Optimizer, nn.Module],
        sharded_muon: Mapping[torch.optim.Optimizer, ShardedMuon] | None = None,
    ) -> None:
        super().__init__()
        self._owner = optimizer_owner
        self._muon = sharded_muon if sharded_muon is not None else {}

    def _stepping(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager[None]:
        muon = self._muon.get(optimizer)
        return muon.patched() if muon is not None else contextlib.nullcontext()

    def _saved_model(self, model: nn.Module) -> nn.Module:
        module = _plain(model)
        return _GatheredView(get_model_state_dict(module, options=_GATHER), module)  # collective

    def _model_sink(self, model: nn.Module) -> TensorSink:
        return DTensorModuleSink(_plain(model))  # each rank reads only its shards' regions

    def _module_of(self, optimizer: torch.optim.Optimizer) -> nn.Module:
        module = self._owner.get(optimizer)
        if module is None:
            raise ValueError("TorchFSDPPlugin checkpoints need the optimizer returned by booster.boost")
        return module

    def _save_replicated_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        shard: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        with self._stepping(optimizer):
            state = get_optimizer_state_dict(self._module_of(optimizer), optimizer, options=_GATHER)  # collective
        self._write_parts(lambda: zero_state_to_parts(state), checkpoint, shard, prefix, size_per_shard, use_async)

    def _load_replicated_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None
    ) -> None:
        meta, tensors = self.load_optimizer_parts(checkpoint, prefix)
        require_names(meta, str(checkpoint))  # torch's FSDP state dicts match parameters by name
        state = zero_state_from_parts(meta, tensors)
        options = StateDictOptions(full_state_dict=True)
        with self._stepping(optimizer):
            set_optimizer_state_dict(self._module_of(optimizer), optimizer, state, options=options)  # collective
