"""Range check for token ids and labels at the vocabulary-parallel layers.

One process of torch raises on an id outside the vocabulary (`F.embedding`, `F.cross_entropy`); split over ranks, an
id no rank owns would silently become a zero embedding or a zero / infinite loss. Ids and labels are replicated over
the tensor-parallel group, so every rank sees the same bad value and raises the same error without a collective.
The cost is one min/max over the ids and one two-element device-to-host read (the one synchronisation any error
check needs).
"""

from __future__ import annotations

import torch

__all__ = ["check_ids_in_vocabulary"]


def check_ids_in_vocabulary(
    ids: torch.Tensor, vocab_size: int, where: str, what: str, ignore_index: int | None = None
) -> None:
    """Raise an IndexError naming the bad value and the vocabulary size when an entry of `ids` is outside
    [0, vocab_size); entries equal to `ignore_index` are skipped (labels that count for nothing)."""
    if ids.numel() == 0:
        return
    checked = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    low, high = torch.stack(torch.aminmax(checked)).tolist()
    if low >= 0 and high < vocab_size:
        return
    bad = low if low < 0 else high
    allowed = f"[0, {vocab_size})" + ("" if ignore_index is None else f" or ignore_index={ignore_index}")
    raise IndexError(f"{where}: {what} {bad} is outside the vocabulary of size {vocab_size} (allowed: {allowed})")
