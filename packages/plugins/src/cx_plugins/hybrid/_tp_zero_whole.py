"""`ZeroTensorParallelWhole`: HybridParallelPlugin at zero_stage 1/2 with tp > 1 steps a matrix-wise optimizer
(torch's Muon, MuonWithAdamW) on whole matrices, composing the two mechanisms that each handle one split.

ZeRO (cx_zero's `_whole_step`) already gathers each parameter's flat shards whole onto one owner rank of its
data-parallel group; under tp that whole is this tp rank's slice of the matrix. Owners come from `assign_owners`
over the shapes, and every tp rank's slices have the same shapes, so the ranks owning the slices of one parameter
sit at the same dp coordinate: exactly one tp group. Those ranks then do what zero_stage 0 does (`_tp_whole`): the
slices' gradients are gathered over tp to a tp owner, which steps the whole matrix, and every rank takes its slice
back into its dp-whole master, which ZeRO scatters to the flat shards. The assumption is checked at construction
(`require_same_owners`), so a layout that breaks it fails there, by name, instead of deadlocking in a step.

The tp step runs in torch's step hooks of the wrapped optimizer (ZeRO calls its `step()` between its gather and its
scatter). The param groups hold the tp-whole masters (or their placeholders); ZeRO's state dict code wants its
dp-whole masters there, so the state dict methods run in `zero_view`, each rank's state being its slice of the tp
owner's state: the layout an elementwise optimizer has, as `HybridParallelOptimizer` saves at zero_stage 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from cx_mesh import ProcessGroup, RankMismatchError, assert_same_across_ranks
from cx_plugins._tp_whole import TensorParallelWholeStep
from cx_shardformer import ShardSpec, get_shard_spec
from cx_zero import LowLevelZeroOptimizer

__all__ = ["ZeroTensorParallelWhole", "require_same_owners"]

_T = TypeVar("_T")


def require_same_owners(owned: list[str], group: ProcessGroup | None, plugin: str) -> None:
    """ValueError on every rank of the tp `group` unless each rank owns (over dp) the slices of the same split
    parameters, `owned` by name in optimizer order. Collective over `group` (one digest all-gather)."""
    try:
        assert_same_across_ranks(owned, group, "the split parameters each tp rank steps whole")
    except RankMismatchError as error:
        raise ValueError(
            f"{plugin}: a whole-tensor optimizer at zero_stage 1/2 with tp_size > 1 needs the tp ranks of each "
            f"data-parallel coordinate to own (through ZeRO's owner ranks, cx_zero.assign_owners) the slices of the "
            f"same parameters, so they can gather them over tp; here they differ (tp slices of different shapes?): "
            f"{error}"
        ) from error


def _swap(optimizer: torch.optim.Optimizer, mapping: Mapping[int, torch.Tensor]) -> None:
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


class ZeroTensorParallelWhole:
    """The tp gather / step / broadcast around ZeRO's whole-tensor step, and the state dicts in ZeRO's view."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        zero: LowLevelZeroOptimizer,
        names: Mapping[int, str],
        group: ProcessGroup | None,
        plugin: str,
    ) -> None:
        self.optimizer = optimizer
        by_id = {id(p): p for p in zero.get_master_to_working_map().values()}
        # id(dp-whole master: this rank's tp slice, whole over dp, in the param groups) -> its working parameter
        working_of = {id(master): by_id[wid] for wid, master in zero.owned_whole_masters().items()}
        sliced: list[tuple[torch.Tensor, ShardSpec, str]] = []  # in optimizer order, the same on every tp rank
        for param_group in optimizer.param_groups:
            for master in param_group["params"]:
                working = working_of.get(id(master))
                spec = get_shard_spec(working) if working is not None else None
                if working is not None and spec is not None:
                    sliced.append((master, spec, names.get(id(working), "?")))
        require_same_owners([name for *_, name in sliced], group, plugin)
        self.step = TensorParallelWholeStep(optimizer, [(m, s) for m, s, _ in sliced], group)  # repoints the groups
        self._to_dp = self.step.master_of_whole()  # id(tp-whole master or placeholder) -> dp-whole master
        self._to_tp = {id(dp): tp for tp, dp in zip(self.step.whole, (m for m, *_ in sliced), strict=True)}
        self._dp_masters = [m for m, *_ in sliced]
        self._hooks = (  # torch's handles: the hooks live as long as the optimizer
            optimizer.register_step_pre_hook(lambda *_: self.step.gather_grads()),
            optimizer.register_step_post_hook(lambda *_: self.step.scatter_masters()),
        )

    @contextlib.contextmanager
    def zero_view(self) -> Iterator[None]:
        """The param groups hold ZeRO's dp-whole masters inside (the tp-whole ones again after)."""
        _swap(self.optimizer, self._to_dp)
        try:
            yield
        finally:
            _swap(self.optimizer, self._to_tp)

    def state_dict(self, save: Callable[[], _T]) -> _T:
        """`save()` (ZeRO's state dict) with each dp-whole master's state set to this rank's slice of its tp owner's
        (collective over tp, then whatever `save` is)."""
        local = self.step.local_states(self.optimizer)  # id(dp-whole master) -> slice state
        added = [m for m in self._dp_masters if local.get(id(m))]
        with self.zero_view():
            for master in added:
                self.optimizer.state[master] = local[id(master)]
            try:
                return save()
            finally:
                for master in added:
                    del self.optimizer.state[master]

    def load_state_dict(self, load: Callable[[], None]) -> None:
        """`load()` (ZeRO's load) in ZeRO's view; the slice states it gave the dp-whole masters rebuilt whole on
        their tp owners, and the tp-whole masters refreshed from the loaded dp-whole ones (collective over tp)."""
        with self.zero_view():
            load()
        local: dict[int, dict[str, Any]] = {}
        for master in self._dp_masters:
            if master in self.optimizer.state:
                local[id(master)] = dict(self.optimizer.state.pop(master))
        tp_wholes = {id(w): w for w in self.step.whole}
        for whole_id, full in self.step.whole_states(local).items():
            self.optimizer.state[tp_wholes[whole_id]] = full
        self.step.refresh_wholes()

    def refresh(self) -> None:
        """After ZeRO's masters changed (a model load): the tp owners' whole masters gathered again."""
        self.step.refresh_wholes()
