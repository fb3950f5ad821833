"""`Precision`: the one spelling of a training precision across cx ("fp32" / "fp16" / "bf16", or the torch dtype).

ColossalAI names precisions by string on its plugins and by dtype on its engines; cx turns either into this enum
with one `parse`, so every layer accepts, rejects and lists them the same way.
"""

from __future__ import annotations

import enum

import torch

__all__ = ["Precision"]


class Precision(enum.Enum):
    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"

    @classmethod
    def parse(
        cls,
        value: str | torch.dtype | Precision | None,
        accepted: tuple[Precision, ...] | None = None,
        *,
        what: str = "precision",
    ) -> Precision:
        """`value` (a name, a dtype, a Precision; None means fp32) as a Precision among `accepted` (default: all);
        otherwise a ValueError naming `what` and listing the accepted values in the caller's spelling."""
        choices = accepted or tuple(cls)
        found: Precision | None
        if value is None:
            found = cls.FP32
        elif isinstance(value, Precision):
            found = value
        elif isinstance(value, torch.dtype):
            found = next((p for p in cls if p.dtype == value), None)
        else:
            found = next((p for p in cls if p.value == value), None)
        if found is not None and found in choices:
            return found
        if isinstance(value, torch.dtype):
            names = ", ".join(str(p.dtype) for p in choices)
            raise ValueError(f"{what}={value} is not supported; accepted: {names}")
        names = ", ".join(repr(p.value) for p in choices)
        raise ValueError(f"unsupported {what} {value!r}; accepted: {names}")

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self]

    @property
    def needs_loss_scaling(self) -> bool:
        """Only fp16 overflows often enough to need a dynamic loss scale (bf16 has fp32's exponent range)."""
        return self is Precision.FP16


_DTYPES = {Precision.FP32: torch.float32, Precision.FP16: torch.float16, Precision.BF16: torch.bfloat16}
