"""`KeySpans`: an attention mask in which every query row attends to one contiguous range of keys, kept as two
[B, S] integer tensors instead of a dense [B, 1, S, S] boolean mask.

Causal attention over packed documents (positions restarting at each document, no padding mask) is such a mask:
row q attends to keys [start of q's document, q]. So are a sliding window, left or right padding, and their
combinations. Ring attention masks each step's block from the spans (O(S) memory, where the dense mask is
O(S^2) per batch row: 1 GiB at S = 32k), which is what keeps ring attention's memory O(S / sp) on packed batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KeySpans", "spans_of_rows"]


@dataclass(frozen=True)
class KeySpans:
    """Row q of batch b attends to keys `start[b, q] <= k < stop[b, q]` (an empty range: to nothing).
    `causal`: every range ends at or before its row's diagonal (stop <= q + 1), so blocks that a causal mask skips
    entirely are skipped here too."""

    start: torch.Tensor  # [B, S] int64
    stop: torch.Tensor  # [B, S] int64
    causal: bool

    def allowed(self, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> torch.Tensor:
        """[B, 1, len(q_pos), len(kv_pos)] boolean mask of the block of rows `q_pos` and keys `kv_pos`."""
        start = self.start.index_select(1, q_pos).unsqueeze(-1)
        stop = self.stop.index_select(1, q_pos).unsqueeze(-1)
        return ((kv_pos >= start) & (kv_pos < stop)).unsqueeze(1)


def spans_of_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(start, stop, contiguous) of a boolean mask block [B, 1, R, K]: [B, R] each, and a 0-d boolean tensor saying
    whether every row's allowed keys are one contiguous range (else the spans do not describe the mask). No host
    read: the caller reads `contiguous` once for all its blocks."""
    rows = mask[:, 0]
    width = rows.shape[-1]
    count = rows.sum(dim=-1)
    first = rows.to(torch.uint8).argmax(dim=-1)
    last = width - 1 - rows.flip(-1).to(torch.uint8).argmax(dim=-1)
    empty = count == 0
    contiguous = ((last - first + 1 == count) | empty).all()
    return first.masked_fill(empty, 0), (last + 1).masked_fill(empty, 0), contiguous
