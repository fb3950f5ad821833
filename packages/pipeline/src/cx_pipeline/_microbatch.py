"""Split a batch (a tensor, or a dict / list / tuple nest of tensors, e.g. a Hugging Face batch dict) into equal
micro-batches along dim 0, and merge per-micro-batch outputs back into one value."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from cx_pipeline._errors import PipelineConfigError

__all__ = ["batch_size_of", "merge_microbatches", "resolve_num_microbatches", "split_batch"]


def _tensor_sizes(value: Any, path: str, found: list[tuple[str, int]]) -> None:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise PipelineConfigError(f"batch entry {path} is a 0-d tensor; every batch tensor needs a batch dim 0")
        found.append((path, value.shape[0]))
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _tensor_sizes(item, f"{path}[{key!r}]", found)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _tensor_sizes(item, f"{path}[{index}]", found)


def batch_size_of(batch: Any) -> int:
    """The shared dim-0 size of every tensor in `batch`; a clear error when they disagree or there are none."""
    found: list[tuple[str, int]] = []
    _tensor_sizes(batch, "batch", found)
    if not found:
        raise PipelineConfigError(
            f"the batch holds no tensors to split into micro-batches (got {type(batch).__name__})"
        )
    sizes = {size for _, size in found}
    if len(sizes) != 1:
        raise PipelineConfigError(
            "every tensor in the batch must have the same batch size (dim 0) to be split into micro-batches, got "
            + ", ".join(f"{path}: {size}" for path, size in found)
        )
    return found[0][1]


def resolve_num_microbatches(batch_size: int, num_microbatches: int | None, microbatch_size: int | None) -> int:
    """How many micro-batches a batch of `batch_size` splits into; num_microbatches wins when both are given."""
    if num_microbatches is not None:
        if batch_size % num_microbatches != 0:
            raise PipelineConfigError(
                f"batch size {batch_size} is not divisible by num_microbatches={num_microbatches}; use a batch size "
                f"that is a multiple of {num_microbatches} or another micro-batch count"
            )
        return num_microbatches
    assert microbatch_size is not None
    if batch_size % microbatch_size != 0:
        raise PipelineConfigError(
            f"batch size {batch_size} is not divisible by microbatch_size={microbatch_size}; use a batch size that "
            f"is a multiple of {microbatch_size}"
        )
    return batch_size // microbatch_size


def _slice(value: Any, start: int, end: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:end]
    if isinstance(value, Mapping):
        return {key: _slice(item, start, end) for key, item in value.items()}
    if isinstance(value, list):
        return [_slice(item, start, end) for item in value]
    if isinstance(value, tuple):
        return tuple(_slice(item, start, end) for item in value)
    return value


def split_batch(batch: Any, num_microbatches: int) -> list[Any]:
    """`num_microbatches` equal slices of every tensor (dim 0) in `batch`; non-tensor entries are shared."""
    size = batch_size_of(batch)
    if size % num_microbatches != 0:
        raise PipelineConfigError(f"batch size {size} is not divisible by num_microbatches={num_microbatches}")
    step = size // num_microbatches
    return [_slice(batch, i * step, (i + 1) * step) for i in range(num_microbatches)]


def _merge(items: Sequence[Any]) -> Any:
    first = items[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack(list(items))
        return torch.cat(list(items), dim=0)
    if isinstance(first, Mapping):
        merged = {key: _merge([item[key] for item in items]) for key in first}
        try:
            return type(first)(**merged)  # ModelOutput and other dict types rebuilt as themselves
        except TypeError:
            return merged
    if isinstance(first, list | tuple):
        parts = [_merge([item[i] for item in items]) for i in range(len(first))]
        return parts if isinstance(first, list) else tuple(parts)
    return first if all(item == first for item in items) else list(items)


def merge_microbatches(outputs: Sequence[Any]) -> Any:
    """Concatenate per-micro-batch outputs along dim 0 (0-d tensors are stacked), keeping their structure."""
    if not outputs:
        return None
    return _merge(outputs)
