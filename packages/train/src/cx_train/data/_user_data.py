"""The user's own data for cx-train (`--data`, `--eval-data` / `--eval-fraction`): token streams from the cache laid
out in windows of the model's sequence (--seq-len + 1 tokens, the models shift the labels themselves; --seq-len under
sequence parallelism), the training windows and the fixed evaluation windows, as `PackedBatch`es (`_packing`).

Plain text is cut into consecutive windows as before (documents' boundaries honoured inside them); data with chats
is packed whole document by document (`--overlong` for a longer one). `--eval-fraction f` holds out the last
round(f x windows) windows of the training data (at least one); they are never trained on. The evaluation set is
packed whole, text split at the window length with one token of overlap, so each of its documents counts once, the
end of the data too. `--eval-data` is tokenised and cached like `--data`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cx_train.data._packing import (
    Layout,
    PackedBatch,
    build_batch,
    document_bounds,
    document_starts,
    fixed_windows,
    packed_windows,
)
from cx_train.data._text_sources import DataError, iter_documents, resolve_data_paths
from cx_train.data._token_cache import TokenStream, token_stream
from cx_train.data._tokenizers import StreamTokenizer, data_tokenizer

__all__ = ["DataSettings", "UserData", "open_user_data", "prepared_data_problem"]


@dataclass(frozen=True)
class DataSettings:
    """The data flags, as `TrainOptions` carries them."""

    data: tuple[str, ...]
    text_field: str = "text"
    eval_data: tuple[str, ...] = ()
    eval_fraction: float = 0.0
    cache_dir: Path | None = None
    workers: int = 1
    overlong: str = "error"  # a chat longer than the window: "error", "truncate" or "drop"


class Windows:
    """The windows of `layout` over a token stream, each `length` tokens once padded."""

    def __init__(self, stream: TokenStream, layout: Layout, length: int, pad_id: int) -> None:
        self.stream, self.layout, self.length, self.pad_id = stream, layout, length, pad_id

    def __len__(self) -> int:
        return len(self.layout)

    def batch(self, indices: torch.Tensor) -> PackedBatch:
        return build_batch(self.stream.tokens, self.stream.flags, self.layout, indices, self.length, self.pad_id)

    def sliced(self, first: int, stop: int) -> Windows:
        return Windows(self.stream, self.layout.sliced(first, stop), self.length, self.pad_id)


class UserData:
    def __init__(self, train: Windows, evaluation: Windows | None, tokenizer: StreamTokenizer) -> None:
        self.train, self.evaluation, self.tokenizer = train, evaluation, tokenizer

    @property
    def reused(self) -> bool:
        """Every token stream came from the cache (nothing was tokenised)."""
        streams = [self.train.stream] + ([self.evaluation.stream] if self.evaluation is not None else [])
        return all(s.reused for s in streams)

    def summary(self) -> str:
        """The data line cx-train prints: the windows, how they are laid out and what did not fit."""
        train = self.train
        stream = train.stream
        packed = "chats packed whole" if stream.chats else "text cut at the window"
        documents = f"{stream.documents} documents" + (f", {stream.chats} of them chats" if stream.chats else "")
        line = f"cx-train: data: {len(train)} training windows of {train.length} tokens from {documents} ({packed}"
        if train.layout.truncated or train.layout.dropped:
            line += f"; {train.layout.truncated} documents truncated, {train.layout.dropped} dropped by --overlong"
        line += ")"
        if self.evaluation is not None:
            line += f", {len(self.evaluation)} evaluation windows"
        return line


def _stream(patterns: tuple[str, ...], flag: str, settings: DataSettings, tokenizer: StreamTokenizer) -> TokenStream:
    paths = resolve_data_paths(patterns, flag)
    return token_stream(paths, tokenizer, settings.text_field, settings.cache_dir, settings.workers)


def _too_short(stream: TokenStream, length: int, flag: str) -> DataError:
    names = ", ".join(str(p) for p in stream.sources)
    if stream.chats:
        return DataError(f"{flag} {names}: no chat fits a window of {length} tokens (--seq-len + 1)")
    return DataError(
        f"{flag} {names}: {stream.tokens.numel()} tokens, shorter than one window of {length} "
        "(--seq-len + 1): add data or lower --seq-len"
    )


def _where(stream: TokenStream, text_field: str, token: int) -> Callable[[int], str]:
    """The place in the files of the i-th document from token `token` on (read again only for an error message)."""

    def where(index: int) -> str:
        first = document_starts(stream.flags, 0, token).numel()  # documents starting before `token`
        seen = 0
        for path in stream.sources:
            for _, place, end in iter_documents(path, text_field):
                seen += end
                if seen > first + index:
                    return place
        return f"document {first + index}"

    return where


def _packed(
    stream: TokenStream, length: int, overlong: str, settings: DataSettings, first: int = 0, evaluation: bool = False
) -> Layout:
    """Whole documents of tokens [first, end) packed; text in an evaluation set split rather than refused."""
    starts, ends = document_bounds(stream.flags, first, stream.tokens.numel())
    rule = "split" if evaluation and not stream.chats else overlong
    return packed_windows(starts, ends, length, rule, _where(stream, settings.text_field, first))


def _evaluation(settings: DataSettings, tokenizer: StreamTokenizer, length: int) -> Windows:
    stream = _stream(settings.eval_data, "--eval-data", settings, tokenizer)
    windows = Windows(stream, _packed(stream, length, settings.overlong, settings, evaluation=True), length,
                      tokenizer.pad_id)  # fmt: skip
    if not len(windows):
        raise DataError(f"--eval-data {', '.join(str(p) for p in stream.sources)}: no document fits a window")
    return windows


def open_user_data(settings: DataSettings, model: str, is_folder: bool, length: int) -> UserData:
    """Tokenise (or find cached) the data and lay it out in windows of `length` tokens (raises `DataError`)."""
    tokenizer = data_tokenizer(model, is_folder)
    stream = _stream(settings.data, "--data", settings, tokenizer)
    if stream.chats:
        train = Windows(stream, _packed(stream, length, settings.overlong, settings), length, tokenizer.pad_id)
    else:
        train = Windows(stream, fixed_windows(0, stream.tokens.numel() // length, length), length, tokenizer.pad_id)
    windows = len(train)
    if windows < 1:
        raise _too_short(stream, length, "--data")
    evaluation: Windows | None = None
    if settings.eval_data:
        evaluation = _evaluation(settings, tokenizer, length)
    elif settings.eval_fraction > 0:
        held = max(1, round(windows * settings.eval_fraction))
        if held >= windows:
            raise DataError(f"--eval-fraction {settings.eval_fraction:g} of {windows} windows leaves none to train on")
        if stream.chats:
            evaluation = train.sliced(windows - held, windows)
        else:  # the held-out text to the end of the data, packed whole from the first held-out token
            tail = _packed(stream, length, "split", settings, (windows - held) * length, evaluation=True)
            evaluation = Windows(stream, tail, length, tokenizer.pad_id)
        train = train.sliced(0, windows - held)
    return UserData(train, evaluation, tokenizer)


def prepared_data_problem(
    settings: DataSettings, model: str, is_folder: bool, length: int, global_batch: int
) -> str | None:
    """Tokenise (or find cached) the data before any process starts; what is wrong with it, or None."""
    try:
        data = open_user_data(settings, model, is_folder, length)
    except DataError as error:
        return str(error)
    if len(data.train) < global_batch:
        return (
            f"--data: {len(data.train)} training windows of {length} tokens, fewer than one global batch of "
            f"{global_batch} (data-parallel size x --batch-size): add data or lower --batch-size / --seq-len"
        )
    return None
