"""How an fp8 payload travels: its bytes and its float32 scale packed into one uint8 message (gloo and NCCL both
take uint8; one message per destination keeps a collective to one call), and `Pending`, the Work of a compressed
collective in flight whose `wait` finishes it (dequantizes, sums) once the bytes have arrived.

`pack_fp8` / `unpack_fp8` / `packed_fp8_nbytes` are public: the compressed collectives and cx_pipeline's fp8 p2p
(one transfer per tensor, the scale in the same message) share this one wire format."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from cx_mesh.fp8._formats import E4M3, Fp8Tensor, check_fp8_dtype, quantize

__all__ = ["SCALE_BYTES", "Pending", "finish", "pack_fp8", "packed_fp8_nbytes", "unpack_fp8", "unpack_rows"]

#: Bytes of one float32 scale on the wire.
SCALE_BYTES = 4
_NO_TIMEOUT = timedelta(0)


def packed_fp8_nbytes(numel: int) -> int:
    """Bytes of the `pack_fp8` message of a tensor of `numel` elements: one per element plus the scale's 4."""
    if numel < 0:
        raise ValueError(f"packed_fp8_nbytes: numel must be >= 0, got {numel}")
    return numel + SCALE_BYTES


def pack_fp8(tensor: torch.Tensor, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """`tensor` quantized to `fp8_dtype` with one scale (TENSORWISE) as a 1-D uint8 message on its device: the fp8
    payload's bytes (row-major), then the float32 scale's 4 bytes. No autograd: a message is data on the wire."""
    quantized = quantize(tensor.detach().reshape(-1), fp8_dtype)
    return torch.cat([quantized.data.view(torch.uint8), quantized.scale.reshape(1).view(torch.uint8)])


def unpack_fp8(
    message: torch.Tensor,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
    fp8_dtype: torch.dtype = E4M3,
) -> torch.Tensor:
    """The values a `pack_fp8(tensor, fp8_dtype)` message carried, dequantized (float32 arithmetic) into `dtype`
    and reshaped to `shape` (flat when None)."""
    check_fp8_dtype(fp8_dtype)
    if message.dtype != torch.uint8 or message.dim() != 1 or message.numel() < SCALE_BYTES:
        raise ValueError(
            f"unpack_fp8 takes a 1-D uint8 message of at least {SCALE_BYTES} bytes (pack_fp8's), got "
            f"{message.dtype} of shape {tuple(message.shape)}"
        )
    numel = message.numel() - SCALE_BYTES
    if shape is not None and math.prod(shape) != numel:
        raise ValueError(f"unpack_fp8: a message of {numel} fp8 elements does not fill shape {tuple(shape)}")
    scale = message[numel:].clone().view(torch.float32).reshape(())  # clone: the scale's bytes need not be 4-aligned
    data = message[:numel].view(fp8_dtype)
    return Fp8Tensor(data if shape is None else data.view(shape), scale).dequantize(dtype)


def unpack_rows(messages: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The float32 values (rows, numel) of equal-sized messages stacked as a (rows, numel + 4) uint8 tensor."""
    numel = messages.shape[1] - SCALE_BYTES
    scales = messages[:, numel:].contiguous().view(torch.float32)  # (rows, 1)
    return messages[:, :numel].view(fp8_dtype).float() * scales


class Pending(dist.Work):
    """A compressed collective in flight: `wait` waits for the exchange, then runs `then` once (dequantize into
    the output, sum). Holds the send and receive buffers until then, as the backend needs them alive.

    With `local` (`then` is only local arithmetic), `is_completed` polls the exchange and, once it has arrived,
    runs `then` there: True means the output is final and the buffers are freed, as for torch's own handles, so a
    caller that polls (cx_zero's bucket reducer) frees fp8 buckets as early as plain ones. A `then` that issues a
    collective (the all-reduce's all-gather) must not run at a poll, where ranks would disagree on whether they
    reach it: such a handle reports completion only once waited for."""

    def __init__(
        self, exchange: dist.Work | None, then: Callable[[], None], *buffers: torch.Tensor, local: bool = True
    ) -> None:
        super().__init__()
        self._exchange = exchange
        self._then: Callable[[], None] | None = then
        self._buffers: tuple[torch.Tensor, ...] = buffers
        self._local = local

    def wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        if self._then is None:
            return True
        if self._exchange is not None:
            self._exchange.wait() if timeout == _NO_TIMEOUT else self._exchange.wait(timeout)
        then, self._then = self._then, None
        then()
        self._buffers = ()
        return True

    def is_completed(self) -> bool:
        if self._then is not None and self._local and (self._exchange is None or self._exchange.is_completed()):
            self.wait()  # the bytes are here: what is left is the local dequantize (and sum)
        return self._then is None


def finish(pending: Pending, async_op: bool) -> dist.Work | None:
    """The Work of an asynchronous call, or (blocking call) None once finished."""
    if async_op:
        return pending
    pending.wait()
    return None
