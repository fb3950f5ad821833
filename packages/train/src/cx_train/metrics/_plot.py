"""Curves of a `--metrics` file as one PNG: the loss (train, and eval where logged), tokens/s, and memory per rank
against the step. Written at the end of a run beside the metrics file (`FILE.png`) and by `cx-train plot FILE.jsonl
[-o OUT.png]`. matplotlib is the optional extra `cx-train[plot]`, imported only here, with the Agg backend (no
display needed)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cx_train.metrics._metrics_file import read_metrics

__all__ = ["PLOT_HINT", "PlotError", "plot_main", "plot_metrics"]

PLOT_HINT = "pip install 'cx-train[plot]' (or pip install matplotlib)"


class PlotError(RuntimeError):
    """No plot: matplotlib is missing or the metrics file holds nothing to draw; the message says which."""


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pairs], [float(v) for _, v in pairs]


def plot_metrics(metrics: Path, output: Path | None = None) -> Path:
    """Draw `metrics` into `output` (default: the metrics path with the suffix .png); returns the PNG's path."""
    try:  # by name: matplotlib is optional, and has no type stubs to check against when absent
        importlib.import_module("matplotlib").use("Agg")  # no display needed
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise PlotError(f"plotting needs matplotlib, which is not installed: {PLOT_HINT}") from None
    if not metrics.is_file():
        raise PlotError(f"{metrics}: no such metrics file")
    records = read_metrics(metrics)
    if not records:
        raise PlotError(f"{metrics}: no metrics lines to plot")
    output = metrics.with_suffix(".png") if output is None else output
    figure, (loss, speed, memory) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss.plot(*_series(records, "loss"), label="train")
    evaluated = [r for r in records if isinstance(r.get("eval_loss"), (int, float))]
    steps = [int(r.get("eval_step", r["step"])) for r in evaluated]
    evals = [float(r["eval_loss"]) for r in evaluated]
    if evals:
        loss.plot(steps, evals, "o-", label="eval")
    loss.set_ylabel("loss")
    loss.legend()
    speed.plot(*_series(records, "tokens_per_s"))
    speed.set_ylabel("tokens/s")
    kind = records[-1].get("memory_kind", "")
    for rank in range(max(len(r.get("memory_bytes", [])) for r in records)):
        pairs = [(r["step"], r["memory_bytes"][rank]) for r in records if len(r.get("memory_bytes", [])) > rank]
        memory.plot([s for s, _ in pairs], [m / 2**20 for _, m in pairs], label=f"rank {rank}")
    memory.set_ylabel("MiB (RSS)" if kind == "rss" else "MiB (CUDA allocated)")
    memory.set_xlabel("step")
    memory.legend(fontsize="small")
    for axes in (loss, speed, memory):
        axes.grid(alpha=0.3)
    figure.suptitle(metrics.name)
    figure.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output, dpi=100)
    plt.close(figure)
    return output


def plot_main(argv: Sequence[str]) -> int:
    """`cx-train plot FILE.jsonl [-o OUT.png]`; exit status 0 drawn, 1 no plot (the reason on stderr)."""
    parser = argparse.ArgumentParser(
        prog="cx-train plot", description="Draw a --metrics file: loss, tokens/s and memory per rank against steps."
    )
    parser.add_argument("metrics", type=Path, help="a metrics file written by cx-train --metrics")
    parser.add_argument("-o", "--output", type=Path, default=None, help="the PNG (default: FILE with suffix .png)")
    args = parser.parse_args(list(argv))
    try:
        written = plot_metrics(args.metrics, args.output)
    except PlotError as error:
        parser.exit(1, f"cx-train plot: error: {error}\n")
    print(f"cx-train: plotted {args.metrics} to {written}", flush=True)
    return 0
