"""Random streams for dropout on sharded activations (the job of Megatron's RNG tracker).

Dropout on an activation every rank holds whole (replicated) must draw the same mask on every rank, or the replicas
drift apart; dropout on a shard (the attention probabilities of this rank's heads, this rank's sequence shard) must
draw a different mask on every rank holding another shard, or heads h and h + heads/tp share one mask. Replicated
dropout uses torch's default generator, which every rank seeds alike. A sharded region names a `DropoutStream`:
each dropout call inside it draws one number from the default generator (the same on every rank), hashes it with
the stream's name and this rank's coordinates into a seed, and runs under that seed in `torch.random.fork_rng`, so
the default generator moves on by that one draw only.

The streams hold no state of their own: they are a function of the default generator's state. Whatever preserves
that state preserves the masks too, in particular `torch.utils.checkpoint`, which restores it before recomputing.
Calls that draw nothing (p = 0, eval mode) pass through and consume nothing. torch.distributed.tensor's RNG trackers
would do this for DTensor ops on CUDA-like devices; cx's layers hold plain tensors and run on CPU too.

Regions are entered by module hooks (`add_dropout_region`); a `TorchFunctionMode` active inside them catches the
dropout functions (`F.dropout` and its variants, which `nn.Dropout` calls, `torch.dropout`, and SDPA's `dropout_p`).
The innermost region decides, so a replicated dropout inside a sharded attention module (GPT-2's `resid_dropout`)
names the replicated stream (None) in its own region.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from cx_mesh import ProcessGroup
from cx_shardformer._comm import group_rank, group_size

__all__ = ["DropoutStream", "add_dropout_region", "dropout_region", "dropout_stream"]


@dataclass(frozen=True)
class DropoutStream:
    """A random stream for dropout on an activation sharded over some groups: `coords` holds this rank's
    (rank, size) in each of them. Ranks with equal coordinates (replicas of the same shard) draw equal masks."""

    name: str
    coords: tuple[tuple[int, int], ...]

    def seed(self, drawn: int) -> int:
        text = f"{drawn}|{self.name}|{self.coords}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def dropout_stream(name: str, groups: Sequence[ProcessGroup | None]) -> DropoutStream | None:
    """The stream of an activation sharded over `groups` (None: the world); None (replicated) when no group has
    more than one rank."""
    coords = tuple((group_rank(group), group_size(group)) for group in groups if group_size(group) > 1)
    return DropoutStream(name, coords) if coords else None


def _python_rate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:  # F.dropout(input, p, training, inplace)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    return bool(training) and float(p) > 0.0


def _aten_rate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:  # torch.dropout(input, p, train)
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.0)
    train = args[2] if len(args) > 2 else kwargs.get("train", False)
    return bool(train) and float(p) > 0.0


def _sdpa_rate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:  # SDPA(q, k, v, attn_mask, dropout_p, ...)
    p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return float(p) > 0.0


_DRAWS: dict[Callable[..., Any], Callable[[tuple[Any, ...], dict[str, Any]], bool]] = {
    **{f: _python_rate for f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout)},
    F.feature_alpha_dropout: _python_rate,
    **{f: _aten_rate for f in (torch.dropout, torch.alpha_dropout, torch.feature_dropout)},
    torch.feature_alpha_dropout: _aten_rate,
    F.scaled_dot_product_attention: _sdpa_rate,
}


def _run_forked(stream: DropoutStream, device: torch.device, call: Callable[[], Any]) -> Any:
    drawn = int(torch.randint(0, 2**62, (1,)).item())  # advances the default (replicated) stream by one draw
    seed = stream.seed(drawn)
    if device.type == "cpu":
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return call()
    module = torch.get_device_module(device.type)
    index = device.index if device.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type):
        with module.device(index):
            module.manual_seed(seed)
        return call()


class _State(threading.local):
    def __init__(self) -> None:
        self.regions: list[tuple[int, DropoutStream | None]] = []
        self.mode: _DropoutMode | None = None


_STATE = _State()


class _DropoutMode(TorchFunctionMode):
    """Active while any region is: runs each drawing dropout call under the innermost region's stream."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        draws = _DRAWS.get(func)
        stream = _STATE.regions[-1][1] if _STATE.regions else None
        if stream is None or draws is None or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        if not draws(args, kwargs):
            return func(*args, **kwargs)
        return _run_forked(stream, args[0].device, lambda: func(*args, **kwargs))


def _push(owner: int, stream: DropoutStream | None) -> None:
    if not _STATE.regions:
        mode = _DropoutMode()
        mode.__enter__()
        _STATE.mode = mode
    _STATE.regions.append((owner, stream))


def _pop(owner: int) -> None:
    if not _STATE.regions or _STATE.regions[-1][0] != owner:
        return
    _STATE.regions.pop()
    if not _STATE.regions and _STATE.mode is not None:
        mode, _STATE.mode = _STATE.mode, None
        mode.__exit__(None, None, None)


class dropout_region:  # noqa: N801  (a context manager used like a function)
    """`with dropout_region(stream):` runs the dropout calls inside under `stream` (None: the replicated one)."""

    def __init__(self, stream: DropoutStream | None) -> None:
        self.stream = stream

    def __enter__(self) -> None:
        _push(id(self), self.stream)

    def __exit__(self, *exc: object) -> None:
        _pop(id(self))


def add_dropout_region(
    module: nn.Module, stream: DropoutStream | None, active: Callable[[nn.Module], bool] | None = None
) -> None:
    """Run `module`'s forward as a region of `stream`, on the calls where `active(module)` holds (default: in
    training mode). The region ends even when the forward raises (torch.utils.checkpoint's early stop does)."""
    is_active = active if active is not None else (lambda m: m.training)
    entered: list[bool] = []

    def enter(mod: nn.Module, args: tuple[Any, ...]) -> None:
        entered.append(is_active(mod))
        if entered[-1]:
            _push(id(mod), stream)

    def leave(mod: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if entered and entered.pop():
            _pop(id(mod))

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
