"""How an fp8 payload travels: its bytes and its float32 scale packed into one uint8 message (gloo and NCCL both
take uint8; one message per destination keeps a collective to one call), and `Pending`, the Work of a compressed
collective in flight whose `wait` finishes it (dequantizes, sums) once the bytes have arrived."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from cx_mesh.fp8._formats import Fp8Tensor

__all__ = ["SCALE_BYTES", "Pending", "finish", "pack", "unpack", "unpack_rows"]

#: Bytes of one float32 scale on the wire.
SCALE_BYTES = 4
_NO_TIMEOUT = timedelta(0)


def pack(quantized: Fp8Tensor) -> torch.Tensor:
    """A 1-D uint8 message: the fp8 payload's bytes, then its one float32 scale's 4 bytes."""
    if quantized.scale.numel() != 1:
        raise ValueError("pack sends one scale per message; quantize the message TENSORWISE")
    payload = quantized.data.reshape(-1).view(torch.uint8)
    return torch.cat([payload, quantized.scale.reshape(1).view(torch.uint8)])


def unpack(message: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of one `pack`ed message."""
    numel = message.numel() - SCALE_BYTES
    scale = message[numel:].clone().view(torch.float32)  # clone: the scale's bytes need not be 4-aligned
    return message[:numel].view(fp8_dtype).float() * scale


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
