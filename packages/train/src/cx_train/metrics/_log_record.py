"""What one log step reports: the numbers of the progress line, of a `--metrics` JSON line and of the TensorBoard
scalars, made once so that the three always agree."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from cx_train.metrics._memory import MemorySample

__all__ = ["LogRecord"]


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))


@dataclass(frozen=True)
class LogRecord:
    step: int
    total_steps: int
    loss: float  # mean over the ranks that computed it and over the steps since the previous log step
    lr: float  # the first parameter group's, after this step's optimizer (and scheduler) step
    grad_norm: float | None  # the global gradient norm of this step, before any clipping
    tokens_per_s: float  # over the steps since the previous log step, every data-parallel rank's tokens
    step_ms: float  # wall time per step since the previous log step
    elapsed_s: float  # since this run's first step (a resumed run starts again at 0)
    eta_s: float  # the remaining steps at this run's mean step time
    memory: MemorySample
    aux_loss: float | None = None  # MoE: the load-balancing loss, mean since the previous log step
    expert_balance: float | None = None  # MoE: the worst layer's busiest expert / the mean expert
    expert_counts: list[list[float]] | None = None  # MoE: tokens per expert per layer since the previous log step
    mfu: float | None = None  # CUDA with a known peak: model FLOPs utilisation, a fraction
    eval_loss: float | None = None  # the evaluation since the previous log step, when there was one
    eval_step: int | None = None  # the step that evaluation ran at

    def line(self) -> str:
        width = 24
        filled = int(width * self.step / self.total_steps)
        text = f"[{'#' * filled}{'.' * (width - filled)}] step {self.step}/{self.total_steps} loss {self.loss:.3f} "
        if self.aux_loss is not None:
            text += f"aux {self.aux_loss:.3f} "
        if self.expert_balance is not None:
            text += f"experts max/mean {self.expert_balance:.2f} "
        if self.eval_loss is not None:
            text += f"eval {self.eval_loss:.3f} "
        text += f"lr {self.lr:.2e} "
        if self.grad_norm is not None:
            text += f"gnorm {self.grad_norm:.3g} "
        text += f"tok/s {self.tokens_per_s:,.0f} {self.step_ms:.0f}ms/step "
        if self.mfu is not None:
            text += f"mfu {100 * self.mfu:.1f}% "
        text += f"elapsed {_clock(self.elapsed_s)} eta {_clock(self.eta_s)} "
        return text + self.memory.text()

    def json(self) -> dict[str, Any]:
        """The `--metrics` object: absent fields are left out (no eval, a dense model, no MFU)."""
        record: dict[str, Any] = {
            "step": self.step,
            "loss": self.loss,
            "eval_loss": self.eval_loss,
            "eval_step": self.eval_step,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "tokens_per_s": self.tokens_per_s,
            "step_ms": self.step_ms,
            "elapsed_s": self.elapsed_s,
            "mfu": self.mfu,
            "aux_loss": self.aux_loss,
            "expert_balance": self.expert_balance,
            "expert_counts": self.expert_counts,  # the histogram cx-plan --expert-load reads
            "memory_kind": self.memory.kind,
            "memory_bytes": self.memory.used,
            "memory_reserved_bytes": self.memory.reserved,
        }
        return {key: value for key, value in record.items() if value is not None}
