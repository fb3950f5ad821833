"""`LazyInitContext` (ColossalAI's name): build a model without allocating it; materialise it at `boost`.

    with LazyInitContext():
        model = transformers.LlamaForCausalLM(config)    # parameters on the meta device, no memory
    optimizer = HybridAdam(model.parameters())            # fine: the same Parameter objects get their values
    model, optimizer, *_ = booster.boost(model, optimizer)  # materialised here, into the plugin's shards

Materialising replays the recorded construction on the CPU (see `_tape.py`), so the values are exactly those
of an eager construction after the same seed (ColossalAI's lazy tensors do not promise that). The replay streams:
each tensor is handed over as soon as construction is done with it and then dropped, so the replay itself holds
only what construction keeps alive at once (a parameter or two), never the whole model. `GeminiPlugin` takes each
parameter straight into its chunk slot (this rank's part kept, the rest dropped: `GeminiDDP(parameter_source=...)`);
the tensor-parallel, expert-parallel and FSDP plugins cut each one to this rank's slice as it arrives
(`_tp.py`, `_fsdp.py`); DDP and LowLevelZero hold every parameter in full on each rank anyway and get the
model materialised in place first
(`torch.utils.swap_tensors`: the user's references and an optimizer built before `boost` stay valid; tied
parameters stay tied). The context's `stats` say how many bytes the last replay held at once.

A model's tape lives only as long as the model's modules are lazy: it is kept in a weak map from module to tape,
entries dropped when the model is materialised or garbage-collected; that map also makes `is_lazy` O(1) for the root.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle

from cx_plugins.lazy._tape import MetaFactories, OpTape, RecordingMode, ReplayStats, TensorRef

__all__ = ["LazyInitContext", "LazyModel", "install_parameter", "is_compatible_with_meta", "is_lazy", "materialize"]

# the tape of every module built under a context and not materialised yet: weak keys, so a model that is dropped
# unmaterialised takes its tape with it; materialising a model removes its modules' entries
_TAPE_OF: weakref.WeakKeyDictionary[nn.Module, OpTape] = weakref.WeakKeyDictionary()
_TAPES: weakref.WeakSet[OpTape] = weakref.WeakSet()  # the tapes still alive (for modules wrapped after the context)


class LazyInitContext:
    """Inside, modules are built on the meta device and their construction is recorded; `materialize(module)` (or
    `booster.boost`) gives them their real values. `default_device`: where materialised tensors go (CPU if None).
    `stats`: bytes held at once by the last replay of this context's tape (`peak_bytes`) and the bytes of the
    tensors it materialised (`wanted_bytes`)."""

    def __init__(self, tensor_cls: Any = None, default_device: torch.device | str | int | None = None) -> None:
        if tensor_cls is not None:
            raise NotImplementedError(
                "LazyInitContext(tensor_cls=...): cx records construction with its own op tape; pass no tensor_cls"
            )
        self.default_device = None if default_device is None else torch.device(default_device)
        self.stats = ReplayStats()
        self._tape: OpTape | None = None
        self._stack: list[Any] = []
        self._hooks: list[RemovableHandle] = []
        self._built: list[nn.Module] = []

    def __enter__(self) -> LazyInitContext:
        if self._tape is not None:
            raise RuntimeError("LazyInitContext is not re-entrant: use one context per `with` block")
        self._tape = OpTape(rng_state=torch.get_rng_state(), default_device=self.default_device, stats=self.stats)
        factories, recording = MetaFactories(), RecordingMode(self._tape)
        factories.__enter__()
        recording.__enter__()
        self._stack = [recording, factories]

        def seen(module: nn.Module, name: str, value: Any) -> None:
            self._built.append(module)

        self._hooks = [
            register_module_parameter_registration_hook(seen),
            register_module_buffer_registration_hook(seen),
            register_module_module_registration_hook(seen),
        ]
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        for manager in self._stack:
            manager.__exit__(kind, error, trace)
        for hook in self._hooks:
            hook.remove()
        built, self._built, self._stack, self._hooks = self._built, [], [], []
        tape, self._tape = self._tape, None
        if error is not None:
            error.add_note(
                "raised while building a model inside cx's LazyInitContext (on the meta device): construction code "
                "that reads tensor values (.item(), data-dependent shapes) cannot run lazily; build this model "
                "without the context"
            )
            return
        if tape is not None:
            _TAPES.add(tape)
            for module in built:
                _TAPE_OF[module] = tape

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


def is_compatible_with_meta() -> bool:
    """ColossalAI's `is_compatible_with_meta()`, which its tests check before building models lazily: whether this
    torch runs tensor ops on the meta device, where `LazyInitContext` builds models (True for every torch cx
    supports; probed, not assumed)."""
    try:
        probe = torch.empty(2, 3, device="meta") @ torch.empty(3, 4, device="meta")
    except (NotImplementedError, RuntimeError):
        return False
    return probe.is_meta and tuple(probe.shape) == (2, 4)


def is_lazy(module: nn.Module) -> bool:
    """Whether `module` was built under a LazyInitContext and is not materialised yet. O(1): a lookup of the root
    in the weak module-to-tape map; a root built outside the context around lazy children is recognised by its
    first tensor."""
    if module in _TAPE_OF:
        return True
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return first is not None and first.device.type == "meta" and any(tape.knows(first) for tape in list(_TAPES))


def materialize(module: nn.Module) -> nn.Module:
    """Replay the construction of `module`'s lazy tensors and put the real values in place."""
    LazyModel(module).stream()
    return module


class LazyModel:
    """A lazily built module's meta tensors, captured before anything else touches them, and their replay.

    `stream(receive)` is cx-zero's `ParameterSource`: each parameter's full value goes to `receive(parameter,
    value)` one at a time (GeminiDDP copies its part into a chunk), or, without `receive`, is swapped into the
    parameter in place. Buffers and tensor attributes are always put in place."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        entries = list(_lazy_tensors(module))
        tapes = {id(t): t for t in (_TAPE_OF.get(m) for m in module.modules()) if t is not None}
        candidates = list(tapes.values()) + [t for t in list(_TAPES) if id(t) not in tapes]
        self._groups: dict[int, tuple[OpTape, list[torch.Tensor]]] = {}  # tape id -> (tape, distinct tensors)
        self._uses: dict[int, list[tuple[nn.Module, str, str]]] = {}  # tensor id -> where it is installed
        self._refs: dict[int, TensorRef] = {}
        unknown = []
        for owner, name, tensor, kind in entries:
            if id(tensor) not in self._uses:
                tape = next((t for t in candidates if t.knows(tensor)), None)
                if tape is None:
                    unknown.append(f"{type(owner).__name__}.{name}")
                    continue
                self._groups.setdefault(id(tape), (tape, []))[1].append(tensor)
                self._refs[id(tensor)] = TensorRef.of(tensor)
                self._uses[id(tensor)] = []
            self._uses[id(tensor)].append((owner, name, kind))
        if unknown:
            raise ValueError(
                f"tensors on the meta device that no LazyInitContext recorded cannot be materialised: {unknown[:5]}"
            )

    def replay_rng_states(self) -> list[torch.Tensor]:
        """The CPU random state each construction tape replays from, in a fixed order (the same on every rank that
        built the same model); writing into one changes what the replay draws (HybridParallelPlugin makes the
        ranks of a replica agree on them)."""
        return [tape.rng_state for tape, _ in self._groups.values()]

    def stream(self, receive: Callable[[nn.Parameter, torch.Tensor], None] | None = None) -> None:
        """Replay each tape once; every tensor is handed over (or installed) as soon as construction is done with
        it, so at most what construction itself held at once is alive (see `OpTape.stream`)."""
        for tape, tensors in self._groups.values():
            device = tape.default_device or torch.device("cpu")

            def take(
                index: int, value: torch.Tensor, tensors: list[torch.Tensor] = tensors, device: torch.device = device
            ) -> None:
                tensor = tensors[index]
                uses = self._uses[id(tensor)]
                if receive is not None and isinstance(tensor, nn.Parameter):
                    receive(tensor, value)
                    return
                done = _install(tensor, _owned(value, device), uses[0][2])
                for owner, name, kind in uses:
                    if kind == "buffer":
                        owner._buffers[name] = done
                    elif kind == "attribute":
                        setattr(owner, name, done)

            tape.stream(torch.device("cpu"), [self._refs[id(t)] for t in tensors], take, tape.stats)
        for owner in self.module.modules():  # materialised: these modules no longer keep the tape alive
            _TAPE_OF.pop(owner, None)


def install_parameter(param: nn.Parameter, value: torch.Tensor) -> None:
    """Swap `value` (a materialised value, or this rank's slice of it) into `param` in place, on `value`'s device."""
    _install(param, _owned(value, value.device), "parameter")


def _owned(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`value` as a tensor of its own on `device`: taken as it is when it already is one (the replay has dropped
    it), copied out when it is a view of a larger construction buffer (which it would otherwise keep alive)."""
    whole = (
        value.storage_offset() == 0
        and value.is_contiguous()
        and value.untyped_storage().nbytes() == value.numel() * value.element_size()
    )
    if whole and value.device == device:
        return value.detach()
    return value.detach().to(device, copy=True).contiguous()


def _install(tensor: torch.Tensor, value: torch.Tensor, kind: str) -> torch.Tensor:
    """Parameters keep their Python identity (swapped in place: optimizers and ties stay valid); buffers and plain
    attributes are replaced by the new tensor."""
    if kind != "parameter":
        return value
    assert isinstance(tensor, nn.Parameter)
    fresh = nn.Parameter(value, requires_grad=tensor.requires_grad)
    fresh.__dict__.update(tensor.__dict__)  # attributes set on the parameter (swap_tensors swaps them too)
    try:
        torch.utils.swap_tensors(tensor, fresh)
    except RuntimeError as error:
        raise RuntimeError(
            "LazyInitContext could not materialise a parameter in place because something still holds a view of "
            "it; release views of lazily built parameters before boost"
        ) from error
    return tensor
