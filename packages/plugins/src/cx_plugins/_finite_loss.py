"""The bf16 non-finite-loss check without a host read on every backward (issue 37).

bf16 has no loss scaler to skip a bad step, so a NaN or infinite loss on any rank must stop every rank with an error
naming the step and the ranks. Each backward only records, on the loss's device, the first backward call whose loss
was not finite here (no collective, no read). The record is all-reduced and read at the checks: before the backward
of each of the first `FIRST_CHECKED_CALLS` calls (a bad loss there stops before its backward, parameters finite),
then before every `every`-th call, and before a checkpoint is saved. A later bad loss is therefore named up to
`every - 1` calls after it happened, by its own step; the parameters may then hold NaN and training resumes from
the last checkpoint, which the check before saving keeps finite.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from cx_mesh import all_gather_flat, all_reduce, communication_device

__all__ = ["FIRST_CHECKED_CALLS", "FINITE_LOSS_CHECK_EVERY", "FiniteLossWatch"]

FIRST_CHECKED_CALLS = 3
FINITE_LOSS_CHECK_EVERY = 10  # one host read per 10 steps: a bad loss is named within a few steps


class FiniteLossWatch:
    """One boosted optimizer's record of non-finite losses (module doc); every rank calls it in the same order."""

    def __init__(self) -> None:
        self.calls = 0
        self._call: torch.Tensor | None = None  # the first backward call whose loss was not finite here (0: none)
        self._step: torch.Tensor | None = None  # and its optimizer step

    def record(self, loss: torch.Tensor, step: int, every: int) -> None:
        """Note this backward call's loss; check all ranks first when the call is one of the checked ones."""
        self.calls += 1
        first_call = self._call if self._call is not None else torch.zeros(1, device=loss.device)
        first_step = self._step if self._step is not None else torch.zeros(1, device=loss.device)
        # device-side only: python numbers go to the kernels as arguments, so nothing is copied or read here
        take = (~torch.isfinite(loss.detach().float())).any() & (first_call == 0)
        self._call, self._step = first_call + take * self.calls, first_step + take * step
        if self.calls <= FIRST_CHECKED_CALLS or self.calls % every == 0:
            self.check(f"at backward call {self.calls}", loss)

    def check(self, when: str, loss: torch.Tensor | None = None) -> None:
        """All ranks: raise FloatingPointError when a loss recorded on any rank was not finite."""
        if self._call is None or self._step is None:
            return
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        mine = torch.cat([self._call, self._step])
        if distributed:
            mine = mine.to(communication_device(None))
        flag = (mine[:1] > 0).float()
        if distributed:
            all_reduce(flag, op=dist.ReduceOp.MAX)  # one element per check; the ranks are named only on failure
        if not flag.item():
            return
        if distributed:
            everyone = torch.empty(2 * dist.get_world_size(), dtype=mine.dtype, device=mine.device)
            all_gather_flat(everyone, mine)
            rows = everyone.view(-1, 2).tolist()
        else:
            rows = [mine.tolist()]
        call = min(int(c) for c, _ in rows if c > 0)
        ranks = [rank for rank, (c, _) in enumerate(rows) if int(c) == call]
        step = next(int(s) for c, s in rows if int(c) == call)
        now = call == self.calls and loss is not None
        rank = dist.get_rank() if distributed else 0
        value = float(loss.detach().float().flatten()[0]) if loss is not None and now and rank in ranks else math.nan
        raise FloatingPointError(_message(ranks, call, step, None if now else when, value))


def _message(ranks: list[int], call: int, step: int, late: str | None, value: float) -> str:
    here = f" (here: {value})" if not math.isnan(value) else ""
    if late is None:
        found = "stopped before backward, which would turn every parameter into NaN"
    else:
        found = (
            f"found {late} (checked on the first {FIRST_CHECKED_CALLS} backward calls, then every "
            "Booster.finite_loss_check_every-th and before a checkpoint is saved), so the parameters may hold NaN"
        )
    return (
        f"bf16 training: the loss is not finite on rank(s) {ranks}{here} at optimizer step {step} (backward call "
        f"{call}); {found}. bf16 has no loss scaling that could skip this step: lower the learning rate, clip "
        "gradients, or check the data of this step; resume from the last checkpoint"
    )
