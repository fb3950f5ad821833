"""`ParallelModule`: the base of every sharded layer. Its state dict holds full-size tensors under the plain
module's names, so a sharded layer and the plain one load each other's state dicts, and a checkpoint never depends
on the tensor-parallel size (vocabulary padding is stripped on save and restored on load)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_mesh.fp8 import ScalingRecipe
from cx_shardformer._shard_spec import get_shard_spec, shard_tensor, unshard_tensor

__all__ = ["ParallelModule"]


class ParallelModule(nn.Module):
    """A module whose parameters may carry a `ShardSpec`; `process_group` is its tensor-parallel group."""

    process_group: ProcessGroup | None
    fp8_recipe: ScalingRecipe | None = None  # use_fp8: the matmul in fp8 (set by `_fp8_switches.apply_fp8`)
    fp8_communication: bool = False  # the TP collectives through cx_mesh.fp8

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, param in self._parameters.items():
            spec = get_shard_spec(param) if param is not None else None
            if param is not None and spec is not None:
                destination[prefix + name] = unshard_tensor(param, spec, self.process_group)

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        replaced: dict[str, Any] = {}
        mutable: dict[str, Any] = state_dict  # type: ignore[assignment]  # torch passes its own dict
        try:
            for name, param in self._parameters.items():
                key = prefix + name
                spec = get_shard_spec(param) if param is not None else None
                if param is None or spec is None or key not in state_dict:
                    continue
                full = state_dict[key]
                expected = spec.full_shape(param.shape)
                if not isinstance(full, torch.Tensor) or full.shape != expected:
                    shape = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
                    error_msgs.append(
                        f"{key}: {type(self).__name__} loads full-size tensors, expected shape {tuple(expected)}, "
                        f"got {shape}"
                    )
                    replaced[key] = full
                    mutable[key] = param.detach()  # keeps torch's own shape check quiet; the error is recorded
                    continue
                replaced[key] = full
                mutable[key] = shard_tensor(full.to(param.device, param.dtype), spec, self.process_group)
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        finally:
            mutable.update(replaced)
