"""Windows over a token stream and the batches made of them: input ids, labels and position ids, document-aware.

A window is a contiguous range [start, start + count) of the stream, count <= the window length L (--seq-len + 1),
padded to L. Inside it, a new segment begins at the window's first token and at every document start (the `START`
flag); position ids restart at 0 in each segment, and the label of a segment's first token is -100, so no token is
predicted from another document. Labels follow the transformers convention (aligned with the input ids, -100 ignored,
the model shifts them); a token whose `TARGET` flag is clear (a chat's prompt) is -100 too. Padding (the tokenizer's
pad id, else EOS) is a segment of its own with labels -100. transformers builds a block-diagonal causal mask from
position ids that restart when it is given no attention mask (`masking_utils.find_packed_sequence_indices`).

Layouts: `fixed_windows` cuts plain text into consecutive windows of L (as cx-train always did, a document running on
into the next window); `packed_windows` packs whole documents greedily in order (chats, and every evaluation set), a
document longer than L refused, truncated to its first L tokens, dropped, or (evaluation of text) split into windows
that overlap by one token, so every token but a document's first is a target exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cx_train.data._chat_records import DataError
from cx_train.data._token_cache import START, TARGET

__all__ = ["IGNORE", "OVERLONG", "Layout", "PackedBatch", "build_batch", "document_bounds", "document_starts",
           "fixed_windows", "packed_windows"]  # fmt: skip

IGNORE = -100
OVERLONG = ("error", "truncate", "drop")


@dataclass(frozen=True)
class PackedBatch:
    """One batch of windows, every tensor long [B, L]."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def to(self, device: torch.device) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.labels.to(device), self.position_ids.to(device))

    def numel(self) -> int:
        return self.input_ids.numel()

    def targets(self) -> int:
        """Tokens the loss counts (labels after the model's shift that are not ignored)."""
        return int((self.labels[:, 1:] != IGNORE).sum())


@dataclass(frozen=True)
class Layout:
    """Windows as (start, count) in the stream, and how many documents were cut to fit."""

    starts: torch.Tensor
    counts: torch.Tensor
    truncated: int = 0
    dropped: int = 0
    split: int = 0

    def __len__(self) -> int:
        return self.starts.numel()

    def sliced(self, first: int, stop: int) -> Layout:
        return Layout(self.starts[first:stop], self.counts[first:stop], self.truncated, self.dropped, self.split)


def fixed_windows(first: int, stop: int, length: int) -> Layout:
    """Windows [first, stop) of the consecutive cut of the stream into windows of `length` tokens."""
    starts = torch.arange(first, stop, dtype=torch.int64) * length
    return Layout(starts, torch.full_like(starts, length))


_BLOCK = 1 << 26  # flags are scanned in blocks of this many tokens: no temporary as large as a big stream


def document_starts(flags: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """The tokens in [first, stop) where a document starts (int64)."""
    found = [torch.nonzero(flags[a : min(a + _BLOCK, stop)] & START).flatten() + a for a in range(first, stop, _BLOCK)]
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64)


def document_bounds(flags: torch.Tensor, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (starts, ends) of the documents in tokens [first, stop), a document beginning at `first`."""
    starts = document_starts(flags, first, stop)
    if starts.numel() == 0 or int(starts[0]) != first:
        starts = torch.cat([torch.tensor([first]), starts])
    return starts, torch.cat([starts[1:], torch.tensor([stop])])


def packed_windows(
    starts: torch.Tensor, ends: torch.Tensor, length: int, overlong: str, where: Callable[[int], str]
) -> Layout:
    """Whole documents packed greedily in order into windows of `length`; `overlong` says what a longer document
    does: "error" (a `DataError` naming `where(its index)`), "truncate", "drop" or "split"."""
    out_starts: list[int] = []
    out_counts: list[int] = []
    truncated = dropped = split = 0
    open_start, filled = 0, 0

    def close() -> None:
        if filled:
            out_starts.append(open_start)
            out_counts.append(filled)

    for index, (start, end) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        size = end - start
        if size <= length:
            if filled and filled + size <= length:
                filled += size
            else:
                close()
                open_start, filled = start, size
            continue
        if overlong == "error":
            raise DataError(
                f"{where(index)}: {size} tokens, longer than the window of {length} (--seq-len + 1): raise --seq-len, "
                "or pass --overlong truncate or --overlong drop"
            )
        close()
        filled = 0
        if overlong == "drop":
            dropped += 1
        elif overlong == "truncate":
            truncated += 1
            out_starts.append(start)
            out_counts.append(length)
        else:  # split: windows overlapping by one token (its last is the next one's context), the rest stays open
            split += 1
            while end - start > length:
                out_starts.append(start)
                out_counts.append(length)
                start += length - 1
            open_start, filled = start, end - start
    close()
    as_tensor = torch.tensor
    return Layout(as_tensor(out_starts, dtype=torch.int64), as_tensor(out_counts, dtype=torch.int64),
                  truncated, dropped, split)  # fmt: skip


def _window(
    tokens: torch.Tensor, flags: torch.Tensor, start: int, count: int, length: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = tokens[start : start + count].to(torch.long)
    marks = flags[start : start + count]
    begins = (marks & START) != 0
    begins[0] = True
    segment = torch.cumsum(begins.to(torch.int64), 0) - 1
    positions = torch.arange(count) - torch.nonzero(begins).flatten()[segment]
    labels = torch.where(((marks & TARGET) != 0) & ~begins, ids, IGNORE)
    pad = length - count
    if pad:
        ids = torch.cat([ids, torch.full((pad,), pad_id, dtype=torch.long)])
        labels = torch.cat([labels, torch.full((pad,), IGNORE, dtype=torch.long)])
        positions = torch.cat([positions, torch.arange(pad)])
    return ids, labels, positions


def build_batch(
    tokens: torch.Tensor, flags: torch.Tensor, layout: Layout, indices: torch.Tensor, length: int, pad_id: int
) -> PackedBatch:
    """The windows `indices` of `layout` as one batch."""
    rows = [
        _window(tokens, flags, int(layout.starts[i]), int(layout.counts[i]), length, pad_id) for i in indices.tolist()
    ]
    ids, labels, positions = (torch.stack([row[k] for row in rows]) for k in range(3))
    return PackedBatch(ids, labels, positions)
