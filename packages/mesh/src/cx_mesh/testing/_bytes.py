"""`count_collective_bytes`: how many bytes this rank hands to each torch.distributed collective and p2p call, for
tests and benchmarks that check what a compressed (fp8) path really sends."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["CollectiveBytes", "count_collective_bytes"]

#: op name -> (position, keyword) of the argument whose bytes count: what this rank hands over (the input of a
#: gather, reduce-scatter or all-to-all; the tensor of an all-reduce, broadcast or p2p call, its buffer for a recv; a
#: scatter's pieces on its source).
_COUNTED: dict[str, tuple[int, str]] = {
    "all_gather_single": (1, "input_tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather": (1, "tensor"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),
    "all_reduce": (0, "tensor"),
    "all_to_all_single": (1, "input"),
    "broadcast": (0, "tensor"),
    "gather": (0, "tensor"),  # each rank hands its tensor to the destination
    "scatter": (1, "scatter_list"),  # the source hands every piece; the others hand nothing (None)
    "send": (0, "tensor"),
    "recv": (0, "tensor"),
    "isend": (0, "tensor"),
    "irecv": (0, "tensor"),
    "batch_isend_irecv": (0, "p2p_op_list"),
}


@dataclass
class CollectiveBytes:
    """Bytes handed to each op (by its torch.distributed name) while the context was open."""

    by_op: dict[str, int] = field(default_factory=dict)
    #: (op, dtype) -> bytes and -> calls: which payloads an fp8 path compressed (bf16 sums) and which it left alone
    #: (a loss's float32 reductions), and how many calls carried them (each fp8 message adds its scales)
    by_dtype: dict[tuple[str, torch.dtype], int] = field(default_factory=dict)
    calls: dict[tuple[str, torch.dtype], int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def add(self, op: str, nbytes: int, dtype: torch.dtype | None = None) -> None:
        self.by_op[op] = self.by_op.get(op, 0) + nbytes
        if dtype is not None:
            self.by_dtype[op, dtype] = self.by_dtype.get((op, dtype), 0) + nbytes
            self.calls[op, dtype] = self.calls.get((op, dtype), 0) + 1


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dist.P2POp):
        return _tensors(value.tensor)
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    return []


def _counting(op: str, original: Callable[..., Any], counts: CollectiveBytes, state: threading.local) -> Any:
    position, keyword = _COUNTED[op]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outermost = not getattr(state, "depth", 0)  # an op implemented by another counted op counts once
        if outermost:
            tensors = _tensors(args[position] if len(args) > position else kwargs.get(keyword))
            by_dtype: dict[torch.dtype, int] = {}
            for tensor in tensors:
                by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.numel() * tensor.element_size()
            for dtype, nbytes in by_dtype.items():  # one call per dtype it carries (a batch may mix them)
                counts.add(op, nbytes, dtype)
            if not by_dtype:
                counts.add(op, 0)
        state.depth = getattr(state, "depth", 0) + 1
        try:
            return original(*args, **kwargs)
        finally:
            state.depth -= 1

    return wrapper


@contextlib.contextmanager
def count_collective_bytes() -> Iterator[CollectiveBytes]:
    """Patch torch.distributed's collectives and p2p calls (all_gather_single/_into_tensor, all_gather,
    reduce_scatter_single/_tensor, all_reduce, all_to_all_single, broadcast, gather, scatter, send/recv/isend/irecv,
    batch_isend_irecv; in `torch.distributed` and `distributed_c10d`) in this process and count the bytes this rank
    hands to each: `.by_op` (op name -> bytes), `.total`, and per (op, dtype) `.by_dtype` (bytes) and `.calls`.
    batch_isend_irecv counts the tensors of all its ops, sends and receives. For tests and benchmarks only: not
    thread-safe against other patchers."""
    counts = CollectiveBytes()
    state = threading.local()
    saved: list[tuple[Any, str, Any]] = []
    try:
        for op in _COUNTED:
            original = getattr(c10d, op, None)
            if original is None:  # an older torch without this name
                continue
            wrapper = _counting(op, original, counts, state)
            for module in (dist, c10d):
                if getattr(module, op, None) is original:
                    saved.append((module, op, original))
                    setattr(module, op, wrapper)
        yield counts
    finally:
        for module, op, original in reversed(saved):
            setattr(module, op, original)
