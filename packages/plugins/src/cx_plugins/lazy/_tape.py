"""The op tape behind `LazyInitContext`: record every tensor op of a model's construction on the meta device, then
replay it for real.

Under the context, factory functions allocate on the meta device (no memory) and a dispatch mode appends each aten op
to a tape. The tape refers to tensors by their storage and geometry (`TensorRef`), never by holding the tensors, so
the parameters keep a use count of one and can later be swapped in place (optimizers built on them stay valid).

Replay runs the ops in recorded order on the CPU from the random state the context started with, so random
initialisations draw exactly the numbers an eager construction on the CPU would have drawn: a lazily built model
materialises to the same values as `Model()` built normally after the same seed. It streams (`OpTape.stream`): a
plan made in one pass over the tape says after which op each storage is last used, and which ops overwrite a
storage whole (a second initialisation), so every tensor is handed over or dropped as early as possible and the
replay holds only what construction itself holds at once (`ReplayStats` records it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MetaFactories", "OpTape", "RecordingMode", "ReplayStats", "TensorRef", "storage_key"]

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


@dataclass(eq=False)  # compared and hashed by identity: kept in weak sets and maps
class OpTape:
    """The ops of one `LazyInitContext`, and the CPU random state it started with."""

    rng_state: torch.Tensor
    default_device: torch.device | None = None
    stats: ReplayStats = field(default_factory=lambda: ReplayStats())
    ops: list[_Op] = field(default_factory=list)
    produced: set[int] = field(default_factory=set)

    def record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        outputs = [TensorRef.of(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.ops.append(_Op(func, *_refer((args, kwargs), self.produced), outputs))
        self.produced.update(ref.key for ref in outputs)

    def stream(
        self,
        device: torch.device,
        wanted: Sequence[TensorRef],
        receive: Callable[[int, torch.Tensor], None],
        stats: ReplayStats | None = None,
    ) -> None:
        """Run the ops for real on `device` (from the recorded random state, leaving the caller's state as it was)
        and hand each `wanted[i]`'s real value to `receive(i, value)` as soon as no later op touches it.

        Memory stays bounded by what construction itself keeps alive at once, not by the model: every real tensor
        is dropped after the last op that uses it (a wanted one right after `receive`), and a tensor that a later op
        overwrites whole without reading it (`normal_`, `zero_`, `copy_`, ...: a second initialisation, as
        transformers' `post_init` does) is dropped after its last use before that and allocated afresh for it. The
        receiver must copy what it keeps out of `value` before returning if it keeps only part of it."""
        plan = _plan(self.ops)
        by_key: dict[int, list[int]] = {}
        for index, ref in enumerate(wanted):
            if ref.key not in self.produced:
                raise KeyError(f"tensor {ref.size} was not recorded by this tape")
            by_key.setdefault(ref.key, []).append(index)
        if stats is not None:
            stats.peak_bytes = 0
            stats.wanted_bytes = sum(wanted[indices[0]].storage.nbytes() for indices in by_key.values())
        real: dict[int, tuple[torch.Tensor, TensorRef]] = {}
        live = _LiveBytes(stats)

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

        def drop(key: int) -> None:
            gone = real.pop(key, None)
            if gone is not None:
                live.remove(gone[0])

        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng_state)
        try:
            with torch.no_grad():
                for position, op in enumerate(self.ops):
                    for key, base_ref in plan.fresh_before.get(position, ()):
                        real[key] = (_fresh(base_ref, device), base_ref)
                        live.add(real[key][0])
                    args, kwargs = tree_map(resolve, (op.args, op.kwargs))
                    already = op.outputs and all(ref.key in real for ref in op.outputs)
                    if not already or _mutates(op.func):  # else a view of something real: counterpart() derives it
                        out = op.func(*args, **kwargs)
                        flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                        for tensor, ref in zip(flat, op.outputs, strict=True):
                            if ref.key not in real:
                                real[ref.key] = (tensor, ref)
                                live.add(tensor)
                        del out, flat
                    del args, kwargs
                    live.note_peak()
                    for key in plan.final_after.get(position, ()):
                        for index in by_key.get(key, ()):
                            receive(index, counterpart(wanted[index]))
                        drop(key)
                    for key in plan.dead_after.get(position, ()):
                        drop(key)
        finally:
            torch.set_rng_state(saved)

    def knows(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self.produced


@dataclass
class ReplayStats:
    """What one `OpTape.stream` kept alive: the largest number of bytes of real tensors (the storages the replay
    held: parameters being built and construction temporaries) at once, and the model's wanted bytes in all."""

    peak_bytes: int = 0
    wanted_bytes: int = 0


class _LiveBytes:
    """Running total of the storages the replay holds (a storage counted once however many views use it)."""

    def __init__(self, stats: ReplayStats | None) -> None:
        self.stats = stats
        self.now = 0

    def add(self, tensor: torch.Tensor) -> None:
        self.now += tensor.untyped_storage().nbytes()

    def remove(self, tensor: torch.Tensor) -> None:
        self.now -= tensor.untyped_storage().nbytes()

    def note_peak(self) -> None:
        if self.stats is not None:
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.now)


# in-place ops that write every element of their first argument without reading it: a later initialisation that
# makes the earlier value dead (`copy_` too, when its source is another tensor)
_OVERWRITES = frozenset(
    {"normal_", "uniform_", "fill_", "zero_", "random_", "exponential_", "log_normal_", "cauchy_", "geometric_",
     "copy_"}
)  # fmt: skip


@dataclass
class _Plan:
    """When each tensor's value is final (handed over or dropped after that op) and which ops need a fresh one."""

    final_after: dict[int, list[int]] = field(default_factory=dict)
    dead_after: dict[int, list[int]] = field(default_factory=dict)  # a value a later op overwrites whole
    fresh_before: dict[int, list[tuple[int, TensorRef]]] = field(default_factory=dict)


def _plan(ops: Sequence[_Op]) -> _Plan:
    """One pass over the tape: each storage's uses, split into lifetimes where an op overwrites it whole."""
    plan = _Plan()
    last_use: dict[int, int] = {}
    base: dict[int, TensorRef] = {}
    for position, op in enumerate(ops):
        inputs = [v for v in tree_flatten((op.args, op.kwargs))[0] if isinstance(v, TensorRef)]
        killed = _overwritten(op, inputs)
        if killed is not None and killed.key in last_use:  # the earlier value is dead: drop it, start afresh
            plan.dead_after.setdefault(last_use.pop(killed.key), []).append(killed.key)
            plan.fresh_before.setdefault(position, []).append((killed.key, base[killed.key]))
        for ref in [*inputs, *op.outputs]:
            last_use[ref.key] = position
        for ref in op.outputs:
            base.setdefault(ref.key, ref)
    for key, position in last_use.items():
        plan.final_after.setdefault(position, []).append(key)
    return plan


def _overwritten(op: _Op, inputs: Sequence[TensorRef]) -> TensorRef | None:
    """The tensor `op` overwrites whole without reading it, if any."""
    name = getattr(getattr(op.func, "overloadpacket", None), "__name__", "")
    if name not in _OVERWRITES or not op.args or not isinstance(op.args[0], TensorRef):
        return None
    target: TensorRef = op.args[0]
    if any(ref.key == target.key for ref in inputs[1:]):
        return None  # reads itself (copy_ from a view of the same storage)
    numel = 1
    for size in target.size:
        numel *= size
    itemsize = torch.empty((), dtype=target.dtype, device=_META).element_size()
    whole = target.offset == 0 and numel * itemsize == target.storage.nbytes() and _contiguous(target)
    return target if whole else None


def _contiguous(ref: TensorRef) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(ref.size, ref.stride, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _fresh(ref: TensorRef, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor with `ref`'s storage size and geometry (about to be overwritten whole)."""
    storage = torch.empty(ref.storage.nbytes(), dtype=torch.uint8, device=device).untyped_storage()
    return torch.empty(0, dtype=ref.dtype, device=device).set_(storage, ref.offset, ref.size, ref.stride)


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
