"""Per-tensor bookkeeping of a `Chunk` and the helpers that place tensors in its buffer.

Kept apart from the chunk's storage so the tensor-level pieces (an entry's slot and state, the empty view a released
tensor shows, swapping a meta tensor in place) are read and tested without the chunk's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cx_chunk._errors import ChunkError
from cx_chunk._layout import TensorSlot
from cx_chunk._states import TensorState

_RELEASABLE = frozenset({TensorState.HOLD, TensorState.FREE})


@dataclass
class _Entry:
    tensor: torch.Tensor
    slot: TensorSlot
    state: TensorState
    hollow: torch.Tensor | None = None
    """What the tensor shows while its chunk is released: its own shape over a storage of zero bytes (made once),
    so `shape` and `numel()` stay the parameter's (ColossalAI's scripts count parameters after boost) while no
    memory is held; reading its values raises torch's storage-size error."""

    slot_view: torch.Tensor | None = None
    """The tensor's slot in the last full buffer it pointed into, kept for the next gather: a chunk refills the
    same buffer every step (`_revive`), so its views stay valid and need not be sliced again per parameter."""

    def gathered_view(self, buffer: torch.Tensor) -> torch.Tensor:
        view = self.slot_view
        if view is None or view._base is not buffer:
            view = buffer[self.slot.begin : self.slot.end].view(self.slot.shape)
            self.slot_view = view
        return view

    def released_view(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.hollow is None or self.hollow.dtype != dtype or self.hollow.device != device:
            hollow = torch.empty(self.slot.shape, dtype=dtype, device=device)
            hollow.untyped_storage().resize_(0)
            self.hollow = hollow
        return self.hollow


def _with_index(device: torch.device | str) -> torch.device:
    """`cuda` -> `cuda:<current>`: buffers are matched by device (a retired buffer is refilled only on its own
    device), and torch.device("cuda") != torch.device("cuda:0")."""
    device = torch.device(device)
    if str(device) == "cuda":  # no index
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _swap_in(tensor: torch.Tensor, view: torch.Tensor) -> None:
    """Make a meta `tensor` (a parameter built lazily) a real one on `view`'s device, in place: the same Python
    object (optimizers and modules that hold it stay valid), same class and `requires_grad`. It gets an empty tensor
    of its own (the caller then points `.data` at its slot, as for any tensor): a tensor made from `view` itself
    would share the chunk buffer's version counter, and every gather would then look like an in-place change of
    the parameter to autograd."""
    empty = torch.empty(0, dtype=view.dtype, device=view.device)
    fresh = (
        nn.Parameter(empty, requires_grad=tensor.requires_grad)
        if isinstance(tensor, nn.Parameter)
        else empty.requires_grad_(tensor.requires_grad)
    )
    fresh.__dict__.update(tensor.__dict__)  # attributes set on the parameter (swap_tensors swaps them too)
    try:
        torch.utils.swap_tensors(tensor, fresh)
    except RuntimeError as error:
        raise ChunkError(
            "a tensor on the meta device could not be placed in its chunk in place because something still holds a "
            "view of it; release views of lazily built parameters first"
        ) from error
