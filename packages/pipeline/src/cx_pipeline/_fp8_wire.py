"""fp8_communication between pipeline stages: how one tensor travels.

A floating tensor (fp16, bf16, fp32, fp64) travels as one uint8 buffer: its fp8 payload (`cx_mesh.fp8.quantize`,
one scale per tensor; E4M3 for activations, E5M2 for gradients) followed by the 4 bytes of its float32 scale, so the
scale travels with the payload in the same transfer and the number of transfers (what the in-order channels count)
does not change. The receiver knows the tensor's shape and dtype from the metadata cache (activations) or from
what it sent (gradients), posts a buffer of `wire_spec`'s size and turns it back with `unpack`. Other tensors
(token ids, masks) travel as they are. With the switch off, nothing here is called.
"""

from __future__ import annotations

import torch

from cx_mesh.fp8 import Fp8Tensor, quantize

__all__ = ["compressible", "pack", "unpack", "wire_spec"]

_COMPRESSIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SCALE_BYTES = 4


def compressible(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` travels as fp8 (floating, and not already fp8)."""
    return dtype in _COMPRESSIBLE


def wire_spec(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """The (shape, dtype) of the buffer that carries a compressible tensor: payload bytes plus the scale's."""
    numel = 1
    for size in shape:
        numel *= size
    return (numel + _SCALE_BYTES,), torch.uint8


def pack(tensor: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """`tensor` quantized to `fp8_dtype`, as uint8 payload bytes then the float32 scale's bytes."""
    q = quantize(tensor.detach(), fp8_dtype)
    scale = q.scale.reshape(1).to(torch.float32)
    return torch.cat([q.data.reshape(-1).view(torch.uint8), scale.view(torch.uint8)])


def unpack(buffer: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The tensor of `shape` and `dtype` that `pack(tensor, fp8_dtype)` carried in `buffer`."""
    numel = buffer.numel() - _SCALE_BYTES
    data = buffer[:numel].view(fp8_dtype).view(shape)
    scale = buffer[numel:].clone().view(torch.float32).reshape(())  # cloned: a float32 view needs 4-byte alignment
    return Fp8Tensor(data, scale).dequantize(dtype)
