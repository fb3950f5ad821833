"""`ValueOracle`: answers the few data-dependent questions a FakeTensor trace asks, so the real model and the real
cx policies run unmodified under `FakeTensorMode`.

FakeTensors carry shapes, not values, so `.item()` / `.tolist()` (an input-id range check, MoE token counts that
size an all-to-all) and ops whose output shape depends on values (`bincount`, `nonzero`, `repeat_interleave`) fail.
The oracle keeps a real "shadow" value for small tensors whose value is known: the token ids, tensors made without
data (arange, randint), what is computed from shadowed tensors, and the router's top-k choice, balanced by default
(token t's slot j picks expert (t*k + j) mod E: what the load-balancing loss aims at). Ops over shadowed inputs run
for real on the shadows and their outputs become FakeTensors of the same shapes; a scalar read of an unshadowed
tensor answers 0 (False: a check that finds no problem).

Routing skew (`Routing`, `--routing-skew S`): the experts of ep rank 0 (experts [0, L), L = E / ep; the traced rank
is ep rank 0, see `stage_rank`) receive s = `hot_rank_load(S, ...)` times their balanced share, the other experts
evenly the rest. Every rank is assumed to route alike, so rank 0 is the hottest rank and receives s x the balanced
rows: the trace then holds the worst rank's dispatch sizes and expert activations. The choice is deterministic:
token t gets h_t = floor((t+1) q) - floor(t q) hot slots (q = s k / ep, so floor(T q) hot slots in all), its
slots 0..h_t-1 pick hot experts and the rest cold ones, each class in turn (the n-th hot slot of the batch picks
expert n mod L, the n-th cold one L + n mod (E - L)), so a token's k experts are distinct. Since the fake process
group's all-to-all returns each rank's own send buffer, a skewed trace answers an equal-split all-to-all of shadowed
integers shaped [ep, E / ep] (the per-expert counts cx-moe's dispatch exchanges) with what every peer sends rank 0:
the input's rank-0 row, for each peer (the traced rank is rank 0 of every group but pp's).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
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

__all__ = ["Routing", "ValueOracle", "hot_rank_load"]

_SMALL = 1 << 22  # elements: a shadow is computed for real only below this (ids, counts, indices; not activations)
_aten = torch.ops.aten
_SCALAR_READS = (_aten._local_scalar_dense.default, _aten.item.default)
_DEVICE_QUERY = torch.ops.prim.device.default  # `tensor.device`: no value to shadow, passed straight on


def hot_rank_load(skew: float, ep: int, num_experts: int, top_k: int) -> float:
    """The hottest ep rank's routed rows over the balanced share, for a hottest-expert skew `skew` (>= 1): at most
    ep (every assignment on that rank) and E / k (an expert takes at most one slot of each token); 1 without ep."""
    if skew < 1:
        raise ValueError(f"routing_skew must be >= 1 (the hottest expert's tokens over the mean's), got {skew}")
    if ep <= 1 or num_experts <= 0 or top_k <= 0:
        return 1.0
    return min(skew, float(ep), num_experts / top_k)


@dataclass(frozen=True)
class Routing:
    """A skewed router for the trace (module docstring): the hot rank's `load` (`hot_rank_load`), the model's
    routed experts and the ep size."""

    load: float
    num_experts: int
    ep: int


class ValueOracle(TorchDispatchMode):
    """Sits above a FakeTensorMode (enter it inside that mode) and supplies values where a trace needs them;
    `routing` skews the router's choice (None or a load of 1: balanced)."""

    def __init__(self, fake_mode: FakeTensorMode, routing: Routing | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.shadows = WeakTensorKeyDictionary()
        self.routing = routing if routing is not None and routing.load > 1 else None

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
        for arg in args:  # most ops' first tensor is an activation with no value: decided before flattening
            if isinstance(arg, torch.Tensor) and self._shadow(arg) is None:
                return False
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
        if func is _DEVICE_QUERY:
            return func(*args, **kwargs)
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
            if self.routing is not None and func is _c10d_all_to_all() and not args[3] and not args[4]:
                self._as_every_peer_sends(args[0], args[1])
        return out

    def _as_every_peer_sends(self, output: torch.Tensor, source: torch.Tensor) -> None:
        """Rank 0's equal-split all-to-all of integer counts, one row per ep peer ([ep, experts per rank], what
        cx-moe's dispatch sends), when every peer routes alike: each peer's row is rank 0's own."""
        assert self.routing is not None
        sent = self._shadow(source)
        peers = self.routing.ep
        if sent is None or sent.dim() != 2 or sent.shape[0] != peers or sent.is_floating_point():
            return
        with unset_fake_temporarily():
            self.shadows[output] = sent[:1].expand(peers, -1).clone()

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
        """Top-k over the last dim of a [.., E] score: token t's slot j picks (t*k + j) mod E (skewed over the
        model's experts under `routing`)."""
        scores, k = args[0], args[1]
        experts = scores.shape[-1]
        if indices.numel() > _SMALL:
            return
        count = indices.numel()
        with unset_fake_temporarily():
            if self.routing is not None and experts == self.routing.num_experts:
                value = _skewed_choice(count // k, k, self.routing).reshape(indices.shape).to(indices.dtype)
            else:
                value = (torch.arange(count, dtype=torch.int64) % experts).reshape(indices.shape).to(indices.dtype)
        self.shadows[indices] = value


def _skewed_choice(tokens: int, k: int, routing: Routing) -> torch.Tensor:
    """[tokens, k] expert ids: ep rank 0's experts take `routing.load` x their share (module docstring)."""
    experts, local = routing.num_experts, routing.num_experts // routing.ep
    q = Fraction(routing.load) * k / routing.ep  # hot slots per token, on average
    t = torch.arange(tokens + 1, dtype=torch.int64)
    before = (t * q.numerator) // q.denominator  # hot slots of the tokens before t: floor(t q)
    hot = (before[1:] - before[:-1]).unsqueeze(1)  # [tokens, 1]
    before = before[:-1].unsqueeze(1)
    slot = torch.arange(k, dtype=torch.int64).unsqueeze(0)
    hot_expert = (before + slot) % local
    cold_before = t[:-1].unsqueeze(1) * k - before
    cold_expert = local + (cold_before + slot - hot) % (experts - local)
    return torch.where(slot < hot, hot_expert, cold_expert)


def _c10d_all_to_all() -> Any:
    return torch.ops.c10d.alltoall_base_.default


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
