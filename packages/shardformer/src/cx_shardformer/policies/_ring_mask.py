"""The transformers mask function registered for `cx_ring` attention: the model's own mask (causal, packed
documents from restarting position_ids, padding, sliding window: whatever transformers composes) kept as
`KeySpans` when every query row attends to one contiguous range of keys, so ring attention never holds an [S, S] mask.

transformers' `sdpa_mask` builds the boolean mask; it is called on blocks of rows (about 16M elements each), whose
spans are read off and the block dropped, so the peak is one block rather than B * S^2 (one host read per mask, for
the whole sequence). A plain causal mask gives
None (ring attention's causal path, as SDPA's `is_causal`), decided from the mask function transformers passes without
building or reading a mask (issue 37); a mask whose rows are not contiguous ranges, or one with
a cache offset, falls back to the dense mask sdpa would use.
"""

from __future__ import annotations

from typing import Any

import torch

from cx_shardformer._spans import KeySpans, spans_of_rows

__all__ = ["ring_mask"]

_BLOCK_ELEMENTS = 1 << 24


def ring_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    allow_is_causal_skip: bool = True,
    **kwargs: Any,
) -> torch.Tensor | KeySpans | None:
    """transformers `AttentionMaskInterface` function (sdpa_mask's arguments): KeySpans, None or a dense mask."""
    from transformers.masking_utils import sdpa_mask

    def dense() -> torch.Tensor | None:
        mask: torch.Tensor | None = sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            allow_is_causal_skip=allow_is_causal_skip, **kwargs,
        )  # fmt: skip
        return mask

    if q_length != kv_length or q_offset != 0 or kv_offset != 0:
        return dense()
    if allow_is_causal_skip and _plain_causal(kwargs):
        return None  # what the spans below would find, without building or reading anything (issue 37)
    block = max(1, _BLOCK_ELEMENTS // max(1, batch_size * kv_length))
    starts, stops, contiguous = [], [], []
    for first in range(0, q_length, block):
        rows = min(block, q_length - first)
        mask = sdpa_mask(
            batch_size=batch_size, q_length=rows, kv_length=kv_length, q_offset=first, kv_offset=0,
            allow_is_causal_skip=False, **kwargs,
        )  # fmt: skip
        if mask is None:
            return dense()
        start, stop, whole = spans_of_rows(mask.expand(batch_size, 1, rows, kv_length))
        starts.append(start)
        stops.append(stop)
        contiguous.append(whole)
    start, stop = torch.cat(starts, dim=1), torch.cat(stops, dim=1)
    diagonal = torch.arange(1, q_length + 1, device=stop.device)
    plain = (start == 0).all() & (stop == diagonal).all()
    # one host read for the whole mask: are the spans exact, is it plain causal, does every span end by its diagonal
    exact, is_plain, causal = torch.stack([torch.stack(contiguous).all(), plain, (stop <= diagonal).all()]).tolist()
    if not exact:
        return dense()
    if allow_is_causal_skip and is_plain:
        return None
    return KeySpans(start=start, stop=stop, causal=bool(causal))


def _plain_causal(kwargs: dict[str, Any]) -> bool:
    """Whether transformers asks for the plain causal mask: its causal mask function, no padding mask, no window
    (known on the host: packed documents or a sliding window come as another mask function)."""
    from transformers.masking_utils import causal_mask_function

    return (
        kwargs.get("mask_function", causal_mask_function) is causal_mask_function
        and kwargs.get("attention_mask") is None
        and kwargs.get("local_size") is None
    )
