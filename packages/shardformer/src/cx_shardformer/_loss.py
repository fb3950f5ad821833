"""`cross_entropy_1d`: cross entropy over vocabulary-parallel logits without gathering them.

Each rank holds logits for its slice of the (padded) vocabulary. The row maximum and the sum of exponentials are
all-reduced, and the target's logit is taken from the rank that owns it; the gradient is softmax minus one-hot on
each rank's slice. Columns past `vocab_size` (padding) are excluded. Labels equal to `ignore_index` count for
nothing; `mode="mean"` divides by the number of counted labels (as `F.cross_entropy` does), "sum" does not. Any other
label outside the vocabulary raises (as `F.cross_entropy` does): no rank would own it, giving a zero or infinite loss.
"""

from __future__ import annotations

import torch

from cx_mesh import ProcessGroup, all_reduce
from cx_shardformer._comm import group_rank, group_size, reduce_forward
from cx_shardformer._ids import check_ids_in_vocabulary

__all__ = ["cross_entropy_1d"]


def cross_entropy_1d(
    vocab_logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    process_group: ProcessGroup | None = None,
    vocab_size: int | None = None,
    dtype: torch.dtype | None = None,
    mode: str = "mean",
    exact_label_check: bool = True,
) -> torch.Tensor:
    """Cross entropy of `vocab_logits` [..., V_local] (this rank's vocabulary slice) against `labels` [...].
    `exact_label_check=False`: a label outside the vocabulary is caught by a device-side assert (`_ids`)."""
    if mode not in ("mean", "sum"):
        raise ValueError(f"cross_entropy_1d: mode must be 'mean' or 'sum', got {mode!r}")
    if vocab_logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"cross_entropy_1d: logits {tuple(vocab_logits.shape)} and labels {tuple(labels.shape)} disagree on the "
            f"leading dimensions"
        )
    logits = vocab_logits.reshape(-1, vocab_logits.shape[-1])
    logits = logits.to(dtype) if dtype is not None else logits.float()
    flat_labels = labels.reshape(-1)
    local_vocab = logits.shape[-1]
    vocab = vocab_size if vocab_size is not None else local_vocab * group_size(process_group)
    check_ids_in_vocabulary(flat_labels, vocab, "cross_entropy_1d", "label", ignore_index, exact_label_check)
    start = group_rank(process_group) * local_vocab
    if vocab_size is not None and vocab_size < start + local_vocab:
        columns = torch.arange(start, start + local_vocab, device=logits.device)
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    with torch.no_grad():
        row_max = logits.max(dim=-1, keepdim=True).values
        all_reduce(row_max, op=torch.distributed.ReduceOp.MAX, group=process_group)
    shifted = logits - row_max
    sum_exp = reduce_forward(shifted.exp().sum(dim=-1), process_group)
    ignored = flat_labels == ignore_index
    local_target = flat_labels - start
    owned = (local_target >= 0) & (local_target < local_vocab) & ~ignored
    index = local_target.masked_fill(~owned, 0).unsqueeze(-1)
    target_logit = shifted.gather(-1, index).squeeze(-1).masked_fill(~owned, 0.0)
    target_logit = reduce_forward(target_logit, process_group)
    losses = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
    total = losses.sum()
    if mode == "sum":
        return total
    return total / (~ignored).sum().clamp(min=1)
