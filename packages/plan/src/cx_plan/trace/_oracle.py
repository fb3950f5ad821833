"""`ValueOracle`: answers the few data-dependent questions a FakeTensor trace asks, so the real model and the real
cx policies run unmodified under `FakeTensorMode`.

FakeTensors carry shapes, not values, so `.item()` / `.tolist()` (an input-id range check, MoE token counts that
size an all-to-all) and ops whose output shape depends on values (`bincount`, `nonzero`, `repeat_interleave`) fail.
The oracle keeps a real "shadow" value for small tensors whose value is known: the token ids, tensors made without
data (arange, randint), what is computed from shadowed tensors, and the router's top-k choice, assumed balanced
(token t's slot j picks expert (t*k + j) mod E: what the load-balancing loss aims at, and the case the memory model
is for). Ops over shadowed inputs run for real on the shadows and their outputs become FakeTensors of the same
shapes; a scalar read of an unshadowed tensor answers 0 (False: a check that finds no problem).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["ValueOracle"]

_SMALL = 1 << 22  # elements: a shadow is computed for real only below this (ids, counts, indices; not activations)
_aten = torch.ops.aten
_SCALAR_READS = (_aten._local_scalar_dense.default, _aten.item.default)


class ValueOracle(TorchDispatchMode):
    """Sits above a FakeTensorMode (enter it inside that mode) and supplies values where a trace needs them."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.shadows = WeakTensorKeyDictionary()

    def give(self, tensor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Declare `tensor`'s value (a real CPU tensor of the same shape)."""
        self.shadows[tensor] = value
        return tensor

    def _shadow(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if not isinstance(value, FakeTensor):
            return value  # a real tensor is its own value
        return self.shadows.get(value)

    def _all_shadowed(self, args: Any, kwargs: Any) -> bool:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        return all(self._shadow(t) is not None for t in tensors)

    def _run_on_shadows(self, func: Any, args: Any, kwargs: Any) -> Any:
        real = func(*tree_map(self._shadow, args), **tree_map(self._shadow, kwargs))
        return real

    def _fake_of(self, real: Any) -> Any:
        def convert(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor):
                fake = self.fake_mode.from_tensor(value)
                self.shadows[fake] = value
                return fake
            return value

        return tree_map(convert, real)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _SCALAR_READS:
            shadow = self._shadow(args[0])
            if shadow is None:
                return _zero_of(args[0].dtype)
            with unset_fake_temporarily():
                return shadow.item()
        shadowed = self._all_shadowed(args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            if not shadowed:
                raise
            with unset_fake_temporarily():
                real = self._run_on_shadows(func, args, kwargs)
            return self._fake_of(real)
        except RuntimeError as error:
            if func is _aten._grouped_mm.default:
                return _grouped_mm_by_shape(func, args, kwargs, error)
            raise
        if func is _aten.topk.default and not shadowed:
            self._balanced_choice(out[1], args)
        elif shadowed and _small(out, args, kwargs) and (_tensors(out) or _writes_arguments(func)):
            with unset_fake_temporarily():
                real = self._run_on_shadows(func, args, kwargs)
            self._remember(out, real, args, kwargs, func)
        return out

    def _remember(self, out: Any, real: Any, args: Any, kwargs: Any, func: Any) -> None:
        outs, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        for fake, value in zip(outs, reals, strict=False):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor) and fake.shape == value.shape:
                self.shadows[fake] = value
        if _writes_arguments(func):  # in-place / out= ops and collectives: their arguments' values changed
            for fake, value in zip(tree_flatten((args, kwargs))[0], tree_flatten(
                    (tree_map(self._shadow, args), tree_map(self._shadow, kwargs)))[0], strict=False):  # fmt: skip
                if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                    self.shadows[fake] = value

    def _balanced_choice(self, indices: torch.Tensor, args: Any) -> None:
        """Top-k over the last dim of a [.., E] score: token t's slot j picks (t*k + j) mod E."""
        scores, k = args[0], args[1]
        experts = scores.shape[-1]
        if indices.numel() > _SMALL:
            return
        count = indices.numel()
        with unset_fake_temporarily():
            value = (torch.arange(count, dtype=torch.int64) % experts).reshape(indices.shape).to(indices.dtype)
        del k
        self.shadows[indices] = value


def _grouped_mm_by_shape(func: Any, args: Any, kwargs: Any, error: RuntimeError) -> Any:
    """torch's meta kernel of `_grouped_mm` takes only bf16, while the CPU kernel also runs fp32 (transformers' default
    MoE experts on CPU): the output shape of the bf16 call, at the inputs' dtype."""
    a, b = args[0], args[1]
    if a.dtype == torch.bfloat16:
        raise error
    low = [t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
    return func(*low, **kwargs).to(a.dtype if b.dtype == a.dtype else b.dtype)


def _writes_arguments(func: Any) -> bool:
    """In-place and out= ops, and c10d's collectives (whose schemas do not mark the outputs they write)."""
    return bool(func._schema.is_mutable) or func.namespace == "c10d"


def _tensors(*values: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor)]


def _small(*values: Any) -> bool:
    return all(t.numel() <= _SMALL for t in _tensors(*values))


def _zero_of(dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return False
    return 0 if not dtype.is_floating_point else 0.0
