"""`GeminiOptimizer`'s state dicts and cx-checkpoint protocols: full optimizer state by parameter name.

A mixin so that `_optimizer` keeps to building the placeholders and stepping. Saving streams full states chunk by
chunk (`_shards.full_states`); loading keeps this rank's flat range of each full value (`_shards.own_part`).
A whole-tensor optimizer (Muon, `_whole`) keeps each parameter's state whole on its owner rank: saving broadcasts it
from there parameter by parameter (`cx_zero._whole_state.broadcast_state`, no pickle), loading keeps it on the owner
only; the same full-by-name form, so either kind of checkpoint names its tensors the same way. Under tensor
parallelism (`GeminiWholeStep.split`) a tp-split parameter's state lives whole on its tp owner: the dp owner stands
in with its slice of it (the layout of an elementwise optimizer's tp-sliced state), which the checkpoint IO then
gathers over tp like any other slice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from cx_checkpoint import OptimizerMeta, TensorSpec, optimizer_tensor_name
from cx_chunk import ChunkManager
from cx_zero._bf16_states import MOMENT_KEYS, Bf16StateAdam
from cx_zero._grad_scaler import BaseGradScaler
from cx_zero._whole_state import broadcast_state
from cx_zero.gemini._ddp import GeminiDDP
from cx_zero.gemini._shards import ShardEntry, full_states, own_part
from cx_zero.gemini._state import is_saver
from cx_zero.gemini._whole import GeminiWholeStep

__all__ = ["GeminiOptimizerStateMixin"]


class GeminiOptimizerStateMixin:
    """State dicts (`state_dict`, `state_shard`, `load_state_dict`) and the cx-checkpoint `TensorSource` /
    `TensorSink` methods of `GeminiOptimizer`, which sets the attributes declared here."""

    optim: torch.optim.Optimizer
    module: GeminiDDP
    manager: ChunkManager
    scaler: BaseGradScaler
    _entries: list[ShardEntry]
    _by_name: dict[str, ShardEntry]
    _scalars_on_device: dict[int, bool] | None
    _bf16_states: Bf16StateAdam | None
    _whole: GeminiWholeStep | None
    _bind: Callable[[], object]  # point the placeholders at their work slices ...
    _unbind: Callable[[], None]  # ... and back at empty storage

    # ---------------------------------------------------------------------------------------------- state
    def _param_groups_meta(self) -> list[dict[str, Any]]:
        groups = []
        for group in self.optim.param_groups:
            hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "param_names": list(group["param_names"])})
        return groups

    def _full_states(self) -> Iterator[tuple[str, str, torch.Tensor | Any]]:
        if self._whole is None:
            yield from full_states(self._entries, self.optim.state, self.manager.chunks())
            return
        split = self._whole.split
        covered = split.covers if split is not None else ()
        sliced = split.local_states() if split is not None else {}  # collective over tp
        for entry in self._entries:  # collective: every rank, the same order
            whole = self._whole.of(entry)
            state = None
            if whole.mine:
                held = id(whole.tensor)
                state = sliced.get(held, {}) if held in covered else self.optim.state.get(whole.tensor, {})
            if whole.local:
                assert state is not None
                full = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
            else:
                full = broadcast_state(state, entry.chunk.group, whole.owner)
            for key in sorted(full):
                yield entry.name, key, full[key]

    def _states_of(self, entry: ShardEntry) -> dict[str, Any]:
        """The optimizer state this rank holds for `entry` (a whole-tensor optimizer's only on the owner)."""
        tensor = entry.holder if self._whole is None else self._whole.of(entry).tensor
        mine = self._whole is None or self._whole.of(entry).mine
        state: dict[str, Any] = self.optim.state.get(tensor, {}) if mine else {}
        return state

    def _load_whole(
        self, entry: ShardEntry, state: Mapping[str, Any], pending: dict[int, dict[str, Any]] | None = None
    ) -> None:
        """A whole-tensor optimizer's full state of `entry`: kept on its owner, checked everywhere; one the tp
        split holds goes to `pending` (by id of the whole master) for `split.load_states`."""
        assert self._whole is not None
        whole = self._whole.of(entry)
        loaded: dict[str, Any] = {}
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                loaded[key] = value
            elif value.dim() == 0:
                loaded[key] = value.detach().to("cpu", copy=True)
            elif value.shape != whole.tensor.shape:
                raise ValueError(
                    f"GeminiOptimizer.load_state_dict: state {key!r} of {entry.name!r} has shape "
                    f"{list(value.shape)}, the parameter has {list(whole.tensor.shape)}"
                )
            else:
                loaded[key] = value.detach().to(whole.tensor.device, copy=True)
        split = self._whole.split
        if whole.mine and split is not None and id(whole.tensor) in split.covers:
            assert pending is not None, "a tp-split state loads through load_state_dict"
            pending[id(whole.tensor)] = loaded
        elif whole.mine:
            self.optim.state[whole.tensor] = loaded

    def state_dict(self, only_rank_0: bool = True) -> dict[str, Any]:
        """`{"state": {param name: {key: full value}}, "param_groups": [hyper-parameters + param_names],
        "grad_scaler": the loss scaler's state}` (a resumed fp16 run must not restart from `initial_scale`)."""
        keep = is_saver(self.module) or not only_rank_0
        state: dict[str, dict[str, Any]] = {}
        for name, key, value in self._full_states():
            if keep:
                state.setdefault(name, {})[key] = value
        if not keep:
            return {}
        return {"state": state, "param_groups": self._param_groups_meta(), "grad_scaler": self.scaler.state_dict()}

    def state_shard(
        self, prefix: str = "", max_shard_size: int = 1024 * 1024 * 1024, only_rank_0: bool = True
    ) -> Iterator[tuple[dict[str, Any], int]]:
        """Stream `{param name: {key: value}}` pieces of about `max_shard_size` bytes; collective."""
        keep = is_saver(self.module) or not only_rank_0
        piece: dict[str, dict[str, Any]] = {}
        size = 0
        for name, key, value in self._full_states():
            if not keep:
                continue
            piece.setdefault(prefix + name, {})[key] = value
            if isinstance(value, torch.Tensor):
                size += value.numel() * value.element_size()
            if 0 < max_shard_size <= size:
                yield piece, size
                piece, size = {}, 0
        if keep and piece:
            yield piece, size

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load full states by parameter name (every rank passes the whole dict; each keeps its part)."""
        if not {"state", "param_groups"} <= set(state_dict) <= {"state", "param_groups", "grad_scaler"}:
            raise ValueError(
                "GeminiOptimizer.load_state_dict: expected keys 'state', 'param_groups' (and optionally "
                f"'grad_scaler'), got {sorted(state_dict)}"
            )
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optim.param_groups):
            raise ValueError(
                f"GeminiOptimizer.load_state_dict: {len(groups)} param groups given, the optimizer has "
                f"{len(self.optim.param_groups)}"
            )
        for number, (saved, current) in enumerate(zip(groups, self.optim.param_groups, strict=True)):
            if set(saved.get("param_names", [])) != set(current["param_names"]):
                raise ValueError(f"GeminiOptimizer.load_state_dict: param group {number} holds other parameters")
            for key, value in saved.items():
                if key not in ("params", "param_names"):
                    current[key] = value
        self._scalars_on_device = None  # the loaded hyper-parameters may say capturable/fused
        unknown = sorted(set(state_dict["state"]) - set(self._by_name))
        if unknown:
            raise ValueError(f"GeminiOptimizer.load_state_dict: state for unknown parameters {unknown}")
        if self._whole is not None:
            pending: dict[int, dict[str, Any]] = {}
            for name, entries in state_dict["state"].items():
                self._load_whole(self._by_name[name], entries, pending)
            if self._whole.split is not None:
                self._whole.split.load_states(pending)  # collective over tp
            if "grad_scaler" in state_dict:
                self.scaler.load_state_dict(dict(state_dict["grad_scaler"]))
            return
        self._bind()
        for name, entries in state_dict["state"].items():
            entry = self._by_name[name]
            state: dict[str, Any] = {}
            for key, value in entries.items():
                state[key] = self._own_part(entry, value)
            self.optim.state[entry.holder] = state
        self._unbind()
        self._settle_moment_dtypes()
        if "grad_scaler" in state_dict:
            self.scaler.load_state_dict(dict(state_dict["grad_scaler"]))

    def _settle_moment_dtypes(self) -> None:
        """Loaded Adam moments in the dtype this optimizer keeps: bf16 with `optimizer_states_dtype=bf16` (fp32
        ones from a checkpoint rounded to nearest), else the master's (bf16 ones cast exactly, as torch does)."""
        if self._bf16_states is not None:
            self._bf16_states.to_bf16()
            return
        for entry in self._entries:
            state = self.optim.state.get(entry.holder, {})
            for key in MOMENT_KEYS:
                value = state.get(key)
                if isinstance(value, torch.Tensor) and value.dtype != entry.holder.dtype:
                    state[key] = value.to(entry.holder.dtype)

    def _own_part(self, entry: ShardEntry, value: Any) -> Any:
        if self._scalars_on_device is None:  # per placeholder: does its group keep scalar state on the device
            self._scalars_on_device = {
                id(p): bool(group.get("capturable") or group.get("fused"))
                for group in self.optim.param_groups
                for p in group["params"]
            }
        return own_part(entry, value, scalars_on_device=self._scalars_on_device.get(id(entry.holder), False))

    # ------------------------------------------------------------------------------- cx-checkpoint protocols
    def checkpoint_meta(self) -> OptimizerMeta:
        """The JSON part of a cx optimizer checkpoint (tensors come from `tensor_chunks`); collective."""
        state: dict[str, dict[str, dict[str, Any]]] = {}
        for name, key, value in self._full_states():
            if isinstance(value, torch.Tensor):
                state.setdefault(name, {})[key] = {"tensor": optimizer_tensor_name(name, key)}
            else:
                state.setdefault(name, {})[key] = {"value": value}
        return OptimizerMeta(self._param_groups_meta(), state)

    def tensor_chunks(self, max_bytes: int) -> Iterator[Mapping[str, torch.Tensor]]:
        """`TensorSource`: `state.<param>.<key>` tensors, yielded on the saving rank; every rank must iterate."""
        for piece, _ in self.state_shard("", max_bytes, True):
            out = {
                optimizer_tensor_name(name, key): value
                for name, entries in piece.items()
                for key, value in entries.items()
                if isinstance(value, torch.Tensor)
            }
            if out:
                yield out

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        """`TensorSink`: the state tensors this optimizer holds now, with full shapes."""
        self._no_split_sink("expected_tensors")
        out: dict[str, TensorSpec] = {}
        for entry in self._entries:
            shape = tuple(entry.chunk.slot(entry.param).shape)
            for key, value in self._states_of(entry).items():
                if isinstance(value, torch.Tensor):
                    full = shape if value.dim() > 0 else ()
                    out[optimizer_tensor_name(entry.name, str(key))] = TensorSpec(full, value.dtype)
        return out

    def owned_region(self, name: str) -> None:
        """`TensorSink`: whole tensors are read; each rank keeps its flat range."""
        return None

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        """`TensorSink`: take one `state.<param>.<key>` tensor."""
        self._no_split_sink("receive")
        for entry in self._entries:
            for key in list(self._states_of(entry)):
                if optimizer_tensor_name(entry.name, str(key)) == name:
                    if self._whole is not None:
                        self._load_whole(entry, {**self._states_of(entry), key: tensor})
                        return
                    self.optim.state[entry.holder][key] = self._own_part(entry, tensor)
                    self._settle_moment_dtypes()
                    return
        raise KeyError(f"GeminiOptimizer.receive: no optimizer state tensor named {name!r}")

    def _no_split_sink(self, method: str) -> None:
        """A tp-split whole state is rebuilt on its tp owner from every tp rank's slice at once (collective), not
        tensor by tensor."""
        if self._whole is not None and self._whole.split is not None:
            raise NotImplementedError(
                f"GeminiOptimizer.{method}: with a whole-tensor optimizer under tensor parallelism the state loads "
                "through load_state_dict (as the Booster's checkpoint IO does)"
            )
