"""`LazyInitContext` (ColossalAI's name): build a model without allocating it; materialise it at `boost`.

    with LazyInitContext():
        model = transformers.LlamaForCausalLM(config)    # parameters on the meta device, no memory
    optimizer = HybridAdam(model.parameters())            # fine: the same Parameter objects get their values
    model, optimizer, *_ = booster.boost(model, optimizer)  # materialised here, then sharded by the plugin

Materialising replays the recorded construction on the CPU (see `_lazy_tape.py`), so the values are exactly those
of an eager construction after the same seed (ColossalAI's lazy tensors do not promise that). Parameters are
swapped in place (`torch.utils.swap_tensors`): the user's references and an optimizer built before `boost` stay
valid; tied parameters stay tied. The whole model is materialised once in host memory before the plugin shards it;
accelerator memory only ever holds what the plugin places there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn

from cx_plugins._lazy_tape import MetaFactories, OpTape, RecordingMode, TensorRef, storage_key

__all__ = ["LazyInitContext", "is_lazy", "materialize"]

_LIVE: list[OpTape] = []  # every context's tape (a model holds no reference to its tape; meta storages are free)


class LazyInitContext:
    """Inside, modules are built on the meta device and their construction is recorded; `materialize(module)` (or
    `booster.boost`) gives them their real values. `default_device`: where materialised tensors go (CPU if None)."""

    def __init__(self, tensor_cls: Any = None, default_device: torch.device | str | int | None = None) -> None:
        if tensor_cls is not None:
            raise NotImplementedError(
                "LazyInitContext(tensor_cls=...): cx records construction with its own op tape; pass no tensor_cls"
            )
        self.default_device = None if default_device is None else torch.device(default_device)
        self._tape: OpTape | None = None
        self._stack: list[Any] = []

    def __enter__(self) -> LazyInitContext:
        if self._tape is not None:
            raise RuntimeError("LazyInitContext is not re-entrant: use one context per `with` block")
        self._tape = OpTape(rng_state=torch.get_rng_state(), default_device=self.default_device)
        factories, recording = MetaFactories(), RecordingMode(self._tape)
        factories.__enter__()
        recording.__enter__()
        self._stack = [recording, factories]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for manager in self._stack:
            manager.__exit__(kind, error, trace)
        self._stack = []
        tape, self._tape = self._tape, None
        if error is not None:
            error.add_note(
                "raised while building a model inside cx's LazyInitContext (on the meta device): construction code "
                "that reads tensor values (.item(), data-dependent shapes) cannot run lazily; build this model "
                "without the context"
            )
            return
        if tape is not None:
            _LIVE.append(tape)

    @staticmethod
    def materialize(module: nn.Module, verbose: bool = False) -> nn.Module:
        """ColossalAI's static call: give a lazily built module its real values (in place); returns it."""
        return materialize(module)


def _lazy_tensors(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor, str]]:
    """(owner, attribute name, tensor, kind) for every meta parameter, buffer or plain tensor attribute."""
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None and param.device.type == "meta":
                yield owner, name, param, "parameter"
        for name, buffer in owner._buffers.items():
            if buffer is not None and buffer.device.type == "meta":
                yield owner, name, buffer, "buffer"
        for name, value in vars(owner).items():
            if isinstance(value, torch.Tensor) and value.device.type == "meta":
                yield owner, name, value, "attribute"


def is_lazy(module: nn.Module) -> bool:
    """Whether `module` has tensors recorded by a LazyInitContext and not materialised yet."""
    return any(_tape_of(tensor) is not None for _, _, tensor, _ in _lazy_tensors(module))


def _tape_of(tensor: torch.Tensor) -> OpTape | None:
    key = storage_key(tensor)
    return next((tape for tape in _LIVE if key in tape.produced), None)


def materialize(module: nn.Module) -> nn.Module:
    """Replay the construction of `module`'s lazy tensors and put the real values in place."""
    entries = list(_lazy_tensors(module))
    if not entries:
        return module
    tapes = {id(tape): tape for tape in (_tape_of(tensor) for _, _, tensor, _ in entries) if tape is not None}
    unknown = [f"{type(owner).__name__}.{name}" for owner, name, tensor, _ in entries if _tape_of(tensor) is None]
    if unknown:
        raise ValueError(
            f"tensors on the meta device that no LazyInitContext recorded cannot be materialised: {unknown[:5]}"
        )
    counterparts: dict[int, Callable[[TensorRef], torch.Tensor]] = {}
    for tape in tapes.values():
        counterparts[id(tape)] = _on(tape.replay(torch.device("cpu")), tape.default_device or torch.device("cpu"))
    swapped: dict[int, torch.Tensor] = {}
    for owner, name, tensor, kind in entries:
        done = swapped.get(id(tensor))
        if done is None:
            value = counterparts[id(_tape_of(tensor))](TensorRef.of(tensor))
            done = _install(tensor, value, kind)
            swapped[id(tensor)] = done
        if kind == "buffer":
            owner._buffers[name] = done
        elif kind == "attribute":
            setattr(owner, name, done)
    return module


def _on(counterpart: Callable[[TensorRef], torch.Tensor], device: torch.device) -> Callable[[TensorRef], torch.Tensor]:
    def value(ref: TensorRef) -> torch.Tensor:
        # a tensor of its own (a view of a shared construction buffer is copied out), on the target device
        return counterpart(ref).detach().to(device, copy=True).contiguous()

    return value


def _install(tensor: torch.Tensor, value: torch.Tensor, kind: str) -> torch.Tensor:
    """Parameters keep their Python identity (swapped in place: optimizers and ties stay valid); buffers and plain
    attributes are replaced by the new tensor."""
    if kind != "parameter":
        return value
    assert isinstance(tensor, nn.Parameter)
    fresh = nn.Parameter(value, requires_grad=tensor.requires_grad)
    try:
        torch.utils.swap_tensors(tensor, fresh)
    except RuntimeError as error:
        raise RuntimeError(
            "LazyInitContext could not materialise a parameter in place because something still holds a view of "
            "it; release views of lazily built parameters before boost"
        ) from error
    return tensor
