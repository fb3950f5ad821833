"""Which optimizers HybridParallelPlugin (and MoeHybridParallelPlugin) can step on the parameters it holds.

Tensor parallelism leaves each rank a row or column slice of a split matrix. An elementwise optimizer (AdamW, SGD,
...) steps a slice exactly as it would step those elements of the whole matrix; one whose update needs the matrix
whole (torch's Muon: Newton-Schulz orthogonalises the matrix) would orthogonalise each slice on its own and train
silently wrong. Those are refused at boost, on every rank (the split is the same everywhere), before any step,
naming the first split parameters; unknown optimizers too, since nothing says their update is elementwise.
Parameters that are not split (tp 1, or only replicated parameters in the optimizer) are stepped whole: any
optimizer is fine there. HybridParallelPlugin does not refuse a declared whole-tensor optimizer (Muon, MuonWithAdamW)
at any zero_stage: at 0 `_tp_whole` gathers each split matrix to an owner rank of the tp group; at 1/2 ZeRO first
gathers each slice whole onto its dp owner, and `_tp_zero_whole` gathers those over tp (cpu_offload too). What stays
refused here is an optimizer not known to be elementwise and not declared whole-tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch.optim import Optimizer

from cx_shardformer import get_shard_spec
from cx_zero import ELEMENTWISE_OPTIMIZERS, is_elementwise, needs_whole_tensors

__all__ = ["refuse_non_elementwise", "refuse_whole_tensor_on_slices"]


def refuse_whole_tensor_on_slices(optimizer: Optimizer, names: Mapping[int, str], plugin: str) -> None:
    """TypeError when a non-elementwise `optimizer` holds a tensor-parallel slice (a parameter with a shard spec)."""
    if is_elementwise(optimizer):
        return
    sliced = [names.get(id(p), "?") for g in optimizer.param_groups for p in g["params"] if get_shard_spec(p)]
    if not sliced:
        return
    kind = (
        "needs each matrix whole (Newton-Schulz / matrix-wise update)"
        if needs_whole_tensors(optimizer)
        else "is not known to be elementwise"
    )
    accepted = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"{plugin}: {type(optimizer).__name__} {kind}, but tensor parallelism gives each rank a slice of "
        f"{len(sliced)} of its parameters (e.g. {sliced[:3]}), so it would step each slice on its own and train "
        f"silently wrong; a declared whole-tensor optimizer (torch's Muon, cx_zero.MuonWithAdamW, "
        f"cx_zero.declare_whole_tensor) is stepped on whole matrices instead; otherwise use an elementwise optimizer "
        f"({accepted})"
    )


def refuse_non_elementwise(optimizer: Optimizer, plugin: str, why: str) -> None:
    """TypeError for any optimizer that is not known to be elementwise (`why`: what slices the parameters)."""
    if is_elementwise(optimizer):
        return
    accepted = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise TypeError(
        f"{plugin}: {type(optimizer).__name__} is not known to be elementwise (Muon and other matrix-wise optimizers "
        f"need each matrix whole), and {why}, so it would train silently wrong; choose one of: {accepted}"
    )
