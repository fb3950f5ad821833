"""The op tape behind `LazyInitContext`: record every tensor op of a model's construction on the meta device, then
replay it for real.

Under the context, factory functions allocate on the meta device (no memory) and a dispatch mode appends each aten op
to a tape. The tape refers to tensors by their storage and geometry (`TensorRef`), never by holding the tensors, so
the parameters keep a use count of one and can later be swapped in place (optimizers built on them stay valid).

Replay runs the ops in recorded order on the CPU from the random state the context started with, so random
initialisations draw exactly the numbers an eager construction on the CPU would have drawn: a lazily built model
materialises to the same values as `Model()` built normally after the same seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MetaFactories", "OpTape", "RecordingMode", "TensorRef", "storage_key"]

_META = torch.device("meta")
# Factories that allocate storage: redirected to the meta device when no device is given. Data-carrying ones
# (`torch.tensor`, ...) and linspace/logspace (models read their values while building) stay real: small constants,
# recorded like everything else. Not torch's own `torch.device("meta")` context: transformers detects that one and
# skips weight initialisation, which would lose the values lazy init must reproduce.
_ALLOCATING = (
    torch.empty, torch.empty_strided, torch.empty_permuted, torch.zeros, torch.ones, torch.full, torch.arange,
    torch.range, torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm, torch.tril_indices,
    torch.triu_indices,
)  # fmt: skip


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (shared by its views and by a Parameter wrapping it)."""
    return int(tensor.untyped_storage()._cdata)


@dataclass(frozen=True)
class TensorRef:
    """A tensor seen by the tape: its storage (kept alive so its key stays unique) and its geometry."""

    key: int
    storage: Any = field(compare=False, repr=False)
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorRef:
        return cls(
            storage_key(tensor),
            tensor.untyped_storage(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            int(tensor.storage_offset()),
            tensor.dtype,
        )


@dataclass
class _Op:
    func: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[TensorRef]


@dataclass
class OpTape:
    """The ops of one `LazyInitContext`, and the CPU random state it started with."""

    rng_state: torch.Tensor
    default_device: torch.device | None = None
    ops: list[_Op] = field(default_factory=list)
    produced: set[int] = field(default_factory=set)

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        outputs = [TensorRef.of(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.ops.append(_Op(func, *_refer((args, kwargs), self.produced), outputs))
        self.produced.update(ref.key for ref in outputs)

    def replay(self, device: torch.device) -> Callable[[TensorRef], torch.Tensor]:
        """Run every op for real on `device` (from the recorded random state, leaving the caller's state as it
        was); returns a function giving the real counterpart of a recorded tensor."""
        real: dict[int, tuple[torch.Tensor, TensorRef]] = {}

        def counterpart(ref: TensorRef) -> torch.Tensor:
            base, base_ref = real[ref.key]
            same = (ref.size, ref.stride, ref.offset) == (base_ref.size, base_ref.stride, base_ref.offset)
            view = base if same else base.as_strided(ref.size, ref.stride, ref.offset)
            return view if view.dtype == ref.dtype else view.view(ref.dtype)

        def resolve(value: Any) -> Any:
            if isinstance(value, TensorRef):
                return counterpart(value)
            if isinstance(value, torch.device) and value.type == "meta":
                return device
            return value

        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        try:
            with torch.no_grad():
                for op in self.ops:
                    args, kwargs = tree_map(resolve, (op.args, op.kwargs))
                    already = op.outputs and all(ref.key in real for ref in op.outputs)
                    if already and not _mutates(op.func):
                        continue  # a view of something already real: counterpart() derives it
                    out = op.func(*args, **kwargs)
                    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                    for tensor, ref in zip(flat, op.outputs, strict=True):
                        real.setdefault(ref.key, (tensor, ref))
        finally:
            torch.set_rng_state(saved)
        return counterpart

    def knows(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self.produced


def _mutates(func: Any) -> bool:
    """Whether an aten op writes into one of its arguments (in-place or out= ops)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _refer(tree: Any, produced: set[int]) -> tuple[Any, Any]:
    """Arguments with every recorded (meta or produced) tensor replaced by its `TensorRef`; other tensors (real
    constants made outside the context) are kept as they are."""

    def to_ref(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and (value.device == _META or storage_key(value) in produced):
            return TensorRef.of(value)
        return value

    args, kwargs = tree_map(to_ref, tree)
    return tuple(args), dict(kwargs)


class MetaFactories(TorchFunctionMode):
    """Allocating factory calls without an explicit device allocate on the meta device."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in _ALLOCATING and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


class RecordingMode(TorchDispatchMode):
    """Appends every aten op to `tape` after running it (on meta tensors, so nothing is allocated)."""

    def __init__(self, tape: OpTape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.tape.record(func, args, kwargs, out)
        return out
