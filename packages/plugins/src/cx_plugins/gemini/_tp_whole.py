"""`GeminiTensorParallelWhole`: GeminiPlugin with tp_size > 1 steps a matrix-wise optimizer (torch's Muon,
MuonWithAdamW) on whole matrices, composing Gemini's dp gather with the tp gather HybridParallelPlugin uses.

Gemini (cx_zero's `GeminiWholeStep`) gathers each parameter's chunk slices whole onto one owner rank of its zero
group; under tp that whole is this rank's tp slice of the matrix. Owners come from `assign_owners` over the shapes,
the same on every tp rank, so the dp owners of one parameter's slices form exactly one tp group; checked here, by
name (`require_same_owners`), instead of deadlocking in a step. Those ranks then run `TensorParallelWholeStep` in the
wrapped optimizer's step hooks (Gemini calls its `step()` between its gather and its scatter): the dp-whole masters
(rebuilt from the chunks each step) and gradients are all-gathered over tp, the tp owner steps the whole matrix, and
every rank takes its slice back into its dp-whole master, which Gemini scatters to the chunk slices. Regathering the
masters every step (one more tp all-gather) keeps a loaded model or checkpoint in effect without a refresh call.
State dicts see each rank's slice of the tp owner's state (`cx_zero.SplitWholeStates`). With Gemini's optimizer data
on the CPU (`auto` placement, `offload_optim_frac > 0`) the dp-whole masters, the tp owner's whole masters and their
state stay there; `TensorParallelWholeStep` moves only the collectives' buffers to the communication device.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from cx_mesh import ProcessGroup, RankMismatchError, assert_same_across_ranks
from cx_plugins._tp_whole import TensorParallelWholeStep
from cx_shardformer import ShardSpec, get_shard_spec
from cx_zero import GeminiWholeStep

__all__ = ["GeminiTensorParallelWhole", "require_same_owners"]


def require_same_owners(owned: list[str], group: ProcessGroup | None) -> None:
    """ValueError on every rank of the tp `group` unless each rank's dp owner steps the slices of the same split
    parameters (`owned`, by name in optimizer order). Collective over `group` (one digest all-gather)."""
    try:
        assert_same_across_ranks(owned, group, "the split parameters each tp rank steps whole")
    except RankMismatchError as error:
        raise ValueError(
            "GeminiPlugin: a whole-tensor optimizer with tp_size > 1 needs the tp ranks of each zero-group coordinate "
            "to own (through Gemini's owner ranks, cx_zero.assign_owners, or kept-gathered chunks) the slices of the "
            f"same parameters, so they can gather them over tp; here they differ: {error}"
        ) from error


class GeminiTensorParallelWhole:
    """The tp gather / step / broadcast around Gemini's whole step; where the tp-split state lives."""

    def __init__(self, optimizer: torch.optim.Optimizer, whole: GeminiWholeStep, group: ProcessGroup) -> None:
        by_tensor = {id(w.tensor): w for w in whole.params.values()}
        sliced: list[tuple[torch.Tensor, ShardSpec, str]] = []  # in optimizer order, the same on every tp rank
        for param_group in optimizer.param_groups:
            for tensor in param_group["params"]:
                w = by_tensor[id(tensor)]
                spec = get_shard_spec(w.entry.param)
                if w.mine and spec is not None:
                    sliced.append((w.tensor, spec, w.entry.name))
        require_same_owners([name for *_, name in sliced], group)
        self._optimizer = optimizer
        self.step = TensorParallelWholeStep(optimizer, [(m, s) for m, s, _ in sliced], group)  # repoints the groups
        self._covers = frozenset(id(m) for m, *_ in sliced)
        self._hooks = (  # torch's handles: the hooks live as long as the optimizer
            optimizer.register_step_pre_hook(lambda *_: self._gather()),
            optimizer.register_step_post_hook(lambda *_: self.step.scatter_masters()),
        )

    def _gather(self) -> None:
        self.step.refresh_wholes()  # the dp-whole masters Gemini just rebuilt from its chunks
        self.step.gather_grads()

    @property
    def covers(self) -> Collection[int]:
        return self._covers

    def local_states(self) -> dict[int, dict[str, Any]]:
        return self.step.local_states(self._optimizer)

    def load_states(self, local: Mapping[int, Mapping[str, Any]]) -> None:
        tp_wholes = {id(w): w for w in self.step.whole}
        for whole_id, full in self.step.whole_states(local).items():
            self._optimizer.state[tp_wholes[whole_id]] = full
