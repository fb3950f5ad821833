"""Where rank 0 sends each log step's numbers besides the progress line: `--metrics FILE.jsonl`, `--tensorboard DIR`,
and at the end a PNG of the metrics beside the file (when matplotlib is installed; otherwise one line says how to
get it). Other ranks hold no files; every rank calls the same methods."""

from __future__ import annotations

import sys
from pathlib import Path

from cx_train.metrics._log_record import LogRecord
from cx_train.metrics._metrics_file import MetricsFile
from cx_train.metrics._plot import PlotError, plot_metrics
from cx_train.metrics._tensorboard import TensorBoardLog

__all__ = ["Reporting"]


class Reporting:
    def __init__(self, metrics: Path | None, tensorboard: Path | None, resumed_step: int | None, master: bool) -> None:
        self._metrics = MetricsFile(metrics, resumed_step) if master and metrics is not None else None
        self._tensorboard = TensorBoardLog(tensorboard, resumed_step) if master and tensorboard is not None else None

    def write(self, record: LogRecord) -> None:
        numbers = record.json()
        if self._metrics is not None:
            self._metrics.write(numbers)
        if self._tensorboard is not None:
            self._tensorboard.write(numbers)

    def close(self, plot: bool = True) -> None:
        """Close the files; with `plot`, draw the metrics file's curves beside it."""
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._metrics is None:
            return
        self._metrics.close()
        if not plot:
            return
        try:
            written = plot_metrics(self._metrics.path)
        except PlotError as error:
            print(f"cx-train: no plot: {error}", file=sys.stderr, flush=True)
        else:
            print(f"cx-train: plotted {self._metrics.path} to {written}", flush=True)
