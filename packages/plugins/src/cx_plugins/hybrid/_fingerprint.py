"""Cheap fingerprints that let ranks compare tensors and input structures without sending them.

`tensor_fingerprint` reads a tensor's bits as integers and returns two int64 sums on the tensor's own device (no host
sync): the plain sum and the sum weighted by position, so that changed values and moved values both show. It is a
check for accidents (a different seed, a different batch), not a cryptographic hash. `text_fingerprint` folds a
string (a description of shapes and dtypes) into one int64.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["tensor_fingerprint", "text_fingerprint"]

_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per pass: bounds the int64 temporaries for a large weight


def tensor_fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """int64[2] on `tensor.device`: (sum of the bit patterns, sum of bit pattern x (position + 1)), wrapping."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    flat = flat.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    width = flat.element_size()
    if width not in _INTEGER_OF_WIDTH:
        raise TypeError(f"tensor_fingerprint: no integer view for {flat.dtype} ({width}-byte elements)")
    bits = flat.view(_INTEGER_OF_WIDTH[width])
    result = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        part = bits[start : start + _CHUNK].to(torch.int64)
        positions = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=flat.device)
        result[0] += part.sum()
        result[1] += (part * positions).sum()
    return result


def text_fingerprint(text: str) -> int:
    """The first 8 bytes of `text`'s SHA-256 as a signed int64 (fits an int64 tensor)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
