"""Range check for token ids and labels at the vocabulary-parallel layers.

One process of torch raises on an id outside the vocabulary (`F.embedding`, `F.cross_entropy`); split over ranks, an
id no rank owns would silently become a zero embedding or a zero / infinite loss. Ids and labels are replicated over
the tensor-parallel group, so every rank sees the same bad value and raises the same error without a collective.

The first `EXACT_CALLS` calls of each layer read the min/max back (a two-element host read) and raise an IndexError
naming the bad value; later calls check on the device (`torch._assert_async`), so the steady-state forward makes no
host sync (issue 37). Where that assert raises at once (CPU) the value is read then and the same IndexError raised; on
an accelerator it stops the process with the assert's message, naming the layer and the vocabulary size.
"""

from __future__ import annotations

import torch

__all__ = ["EXACT_CALLS", "FirstCalls", "check_ids_in_vocabulary"]

EXACT_CALLS = 3


class FirstCalls:
    """True for the first `count` calls, then False: which calls of one layer read the check on the host."""

    def __init__(self, count: int = EXACT_CALLS) -> None:
        self.left = count

    def __call__(self) -> bool:
        self.left -= 1
        return self.left >= 0


def check_ids_in_vocabulary(
    ids: torch.Tensor, vocab_size: int, where: str, what: str, ignore_index: int | None = None, exact: bool = True
) -> None:
    """Raise an IndexError naming the bad value and the vocabulary size when an entry of `ids` is outside
    [0, vocab_size); entries equal to `ignore_index` are skipped (labels that count for nothing). With
    `exact=False` the check is a device-side assert (module doc)."""
    if ids.numel() == 0:
        return
    checked = ids if ignore_index is None else ids.masked_fill(ids == ignore_index, 0)
    bounds = torch.stack(torch.aminmax(checked))
    allowed = f"[0, {vocab_size})" + ("" if ignore_index is None else f" or ignore_index={ignore_index}")
    if not exact:
        inside = (bounds[0] >= 0) & (bounds[1] < vocab_size)
        try:
            torch._assert_async(inside, f"{where}: a {what} is outside the vocabulary of size {vocab_size} ({allowed})")
            return
        except RuntimeError:
            pass  # the assert ran at once: name the value below
    low, high = bounds.tolist()
    if low >= 0 and high < vocab_size:
        return
    bad = low if low < 0 else high
    raise IndexError(f"{where}: {what} {bad} is outside the vocabulary of size {vocab_size} (allowed: {allowed})")
