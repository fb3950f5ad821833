"""The user's own data for cx-train (`--data`, `--eval-data` / `--eval-fraction`): token streams from the cache cut
into windows of the model's sequence (--seq-len + 1 tokens, the models shift the labels themselves; --seq-len under
sequence parallelism), the training windows and the fixed evaluation windows.

`--eval-fraction f` holds out the last round(f x windows) windows of the training data (at least one); they are
never trained on. `--eval-data` is tokenised and cached like `--data`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from cx_train.data._text_sources import DataError, resolve_data_paths
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


class _Windows:
    """Non-overlapping windows of `length` tokens over a token stream (the last partial one dropped)."""

    def __init__(self, stream: TokenStream, length: int, start: int = 0, stop: int | None = None) -> None:
        self.stream, self.length = stream, length
        self.start = start
        self.stop = stream.tokens.numel() // length if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def batch(self, indices: torch.Tensor) -> torch.Tensor:
        rows = [self.stream.tokens[(self.start + i) * self.length : (self.start + i + 1) * self.length] for i in
                indices.tolist()]  # fmt: skip
        return torch.stack(rows).to(torch.long)


class UserData:
    def __init__(self, train: _Windows, evaluation: _Windows | None, tokenizer: StreamTokenizer) -> None:
        self.train, self.evaluation, self.tokenizer = train, evaluation, tokenizer

    @property
    def reused(self) -> bool:
        """Every token stream came from the cache (nothing was tokenised)."""
        streams = [self.train.stream] + ([self.evaluation.stream] if self.evaluation is not None else [])
        return all(s.reused for s in streams)


def _stream(patterns: tuple[str, ...], flag: str, settings: DataSettings, tokenizer: StreamTokenizer) -> TokenStream:
    paths = resolve_data_paths(patterns, flag)
    return token_stream(paths, tokenizer, settings.text_field, settings.cache_dir, settings.workers)


def _too_short(stream: TokenStream, length: int, flag: str) -> DataError:
    names = ", ".join(str(p) for p in stream.sources)
    return DataError(
        f"{flag} {names}: {stream.tokens.numel()} tokens, shorter than one window of {length} "
        "(--seq-len + 1): add data or lower --seq-len"
    )


def open_user_data(settings: DataSettings, model: str, is_folder: bool, length: int) -> UserData:
    """Tokenise (or find cached) the data and cut it into windows of `length` tokens (raises `DataError`)."""
    tokenizer = data_tokenizer(model, is_folder)
    stream = _stream(settings.data, "--data", settings, tokenizer)
    windows = stream.tokens.numel() // length
    if windows < 1:
        raise _too_short(stream, length, "--data")
    evaluation: _Windows | None = None
    if settings.eval_data:
        eval_stream = _stream(settings.eval_data, "--eval-data", settings, tokenizer)
        if eval_stream.tokens.numel() < length:
            raise _too_short(eval_stream, length, "--eval-data")
        evaluation = _Windows(eval_stream, length)
    elif settings.eval_fraction > 0:
        held = max(1, round(windows * settings.eval_fraction))
        if held >= windows:
            raise DataError(f"--eval-fraction {settings.eval_fraction:g} of {windows} windows leaves none to train on")
        evaluation = _Windows(stream, length, windows - held, windows)
        windows -= held
    return UserData(_Windows(stream, length, 0, windows), evaluation, tokenizer)


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
