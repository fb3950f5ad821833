"""A plain `nn.Module` as `TensorSource` (its full state dict, gathered from DTensors) and as `TensorSink`.

The sink copies each tensor into the module's own parameters and buffers in place, so loading needs no second copy
of the model. DTensor parameters are gathered for saving (`gather_dtensor=True`); loading into DTensors belongs to
the parallel plugins' own sinks and is refused here with a clear error.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from cx_checkpoint._protocols import Region, TensorSpec

__all__ = ["ModuleSink", "ModuleSource", "chunk_by_bytes", "full_state"]


def full_state(tensors: Mapping[str, torch.Tensor], gather_dtensor: bool, what: str) -> dict[str, torch.Tensor]:
    """`tensors` with every DTensor replaced by its full tensor (or an error when gathering is off)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            if not gather_dtensor:
                raise NotImplementedError(
                    f"{what} {name!r} is a DTensor and gather_dtensor=False: the cx format stores full tensors only, "
                    "so DTensors must be gathered (gather_dtensor=True) or saved through a plugin's TensorSource"
                )
            tensor = tensor.full_tensor()
        out[name] = tensor.detach()
    return out


def chunk_by_bytes(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Split a name -> tensor mapping into dicts of at most `max_bytes` (a larger tensor alone)."""
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = {}, 0
        chunk[name] = tensor
        size += nbytes
    if chunk:
        yield chunk


class ModuleSource:
    """`TensorSource` over a module's state dict."""

    def __init__(self, module: nn.Module, gather_dtensor: bool = True) -> None:
        self._state = full_state(module.state_dict(), gather_dtensor, "model tensor")

    def tensor_chunks(self, max_bytes: int) -> Iterator[Mapping[str, torch.Tensor]]:
        yield from chunk_by_bytes(self._state, max_bytes)


class ModuleSink:
    """`TensorSink` that copies full tensors into a module's parameters and buffers in place."""

    def __init__(self, module: nn.Module) -> None:
        self._targets = module.state_dict(keep_vars=True)
        for name, tensor in self._targets.items():
            if isinstance(tensor, DTensor):
                raise NotImplementedError(
                    f"model tensor {name!r} is a DTensor: GeneralCheckpointIO loads plain tensors only; load DTensor "
                    "models through their parallel plugin's CheckpointIO (a TensorSink that keeps each rank's part)"
                )

    def expected_tensors(self) -> Mapping[str, TensorSpec]:
        return {name: TensorSpec.of(tensor) for name, tensor in self._targets.items()}

    def owned_region(self, name: str) -> Region | None:
        return None

    def receive(self, name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            self._targets[name].copy_(tensor)
