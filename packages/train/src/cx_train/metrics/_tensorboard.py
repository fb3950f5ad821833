"""`--tensorboard DIR`: the log steps' numbers as TensorBoard scalars (torch.utils.tensorboard, which needs the
`tensorboard` package: the optional extra `cx-train[tensorboard]`). A resumed run purges the events past its step,
so TensorBoard shows each step once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TENSORBOARD_HINT", "TensorBoardLog", "tensorboard_missing"]

TENSORBOARD_HINT = "pip install 'cx-train[tensorboard]' (or pip install tensorboard)"


def tensorboard_missing() -> str | None:
    """Why --tensorboard cannot work here (None when it can)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return f"--tensorboard needs the tensorboard package, which is not installed: {TENSORBOARD_HINT}"
    return None


class TensorBoardLog:
    def __init__(self, directory: Path, resumed_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resumed_step is None else resumed_step + 1
        self._writer = SummaryWriter(log_dir=str(directory), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key == "step":
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"train/{key}", value, step)
            elif isinstance(value, list):  # per-rank memory
                for rank, number in enumerate(value):
                    self._writer.add_scalar(f"{key}/rank{rank}", number, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
