"""The global gradient norm for the log: `--clip`'s own measurement when clipping, otherwise one taken at log steps.

Every boosted optimizer's `clip_grad_by_norm` returns the norm over all of its ranks' gradients (tp shards, pp
stages, ZeRO / Gemini / FSDP shards, unscaled), which a plain `torch.nn.utils.clip_grad_norm_` on one rank would not.
With a bound no finite fp32 norm reaches, nothing is scaled (a factor of exactly 1), so the call only measures.
It is collective and costs a pass over the gradients, so without --clip it runs at log steps only: `clip_bound`
gives the bound the step clips by, 0 for no call at all.
"""

from __future__ import annotations

import torch

__all__ = ["NO_BOUND", "clip_bound"]

NO_BOUND = float(torch.finfo(torch.float32).max)


def clip_bound(clip: float, logging: bool) -> float:
    """The max norm this step clips by: `clip` when clipping, NO_BOUND (measure only) at a log step, else 0 (none)."""
    if clip > 0:
        return clip
    return NO_BOUND if logging else 0.0
