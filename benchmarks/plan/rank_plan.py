"""cx-plan's step-time ranking against measurement on this CPU: for each (model, ranks) group, the top 3 by predicted
step time, measured side by side; writes `ranking.jsonl` beside this file and prints the RESULTS.md section.

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .nox/tests/bin/python benchmarks/plan/rank_plan.py
[model:ranks ...]` (default: every group below; `CX_BENCH_REPORT_ONLY=1` rewrites the section from `ranking.jsonl`).
The models and candidates are measure_plan.py's (hidden 64, 2 layers, seq 32, fp32, global batch 2 per rank, torch
AdamW, the `cpu` device). Protocol: the group's three configurations are built in the same ranks (no memory tracker:
its per-op bookkeeping would be timed too) and take turns step by step (`bench_timing.time_in_turns`, the same
batch, between barriers), so drift on this shared machine hits all three alike; WARMUP steps each, then ROUNDS rounds
of STEPS steps. Each configuration's time is the median of all its steps, its spread the range of its round medians
(`cx_plan.measure._agreement`: a tie when two medians differ by less than the larger spread).
No assertion: this is a report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from cx_mesh.testing import spawn
from cx_plan import SearchSpace, load_model_shape, plan
from cx_plan._candidate import Candidate
from cx_plan._devices import lookup_device
from cx_plan._planner import traced_memory_model
from cx_plan._report import row_label
from cx_plan.measure._agreement import Timing, agreement, timing
from cx_plan.measure._measure import _prepare

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared step timing
from bench_timing import time_in_turns

HIDDEN, LAYERS, SEQ = 64, 2, 32
WARMUP, ROUNDS, STEPS = 2, 3, 5
GROUPS = [("gpt", 1), ("gpt", 2), ("gpt", 4), ("llama", 1), ("llama", 2), ("llama", 4), ("mixtral", 2),
          ("mixtral", 4), ("deepseek_v3", 2), ("deepseek_v3", 4)]  # fmt: skip
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "ranking.jsonl"


def _rank(rank: int, world: int, model: str, fields: list[dict[str, Any]], out: str) -> None:
    torch.set_num_threads(1)
    systems = {}
    for index, f in enumerate(fields):
        step = _prepare(Candidate(**f), model, HIDDEN, LAYERS, SEQ)
        systems[str(index)] = lambda _ids, step=step: step()
    rounds: dict[str, list[list[float]]] = {name: [] for name in systems}
    for r in range(ROUNDS):
        times = time_in_turns(systems, lambda i: torch.zeros(1), WARMUP if r == 0 else 0, STEPS)
        for name, steps in times.items():
            rounds[name].append([t / 1e3 for t in steps])
    if rank == 0:
        Path(out, "times.json").write_text(json.dumps(rounds))


def measure_group(model: str, world: int) -> dict[str, Any]:
    shape = load_model_shape(model, hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    device = lookup_device("cpu")
    space = SearchSpace(global_batch=2 * world, checkpoint_ratios=(0.0,), precision="fp32")
    report = plan(shape, world, SEQ, device, traced_memory_model(shape, SEQ, device), space=space)
    top = [row for row in report.rows if row.memory.fits][:3]
    fields = [{name: getattr(row.candidate, name) for name in row.candidate.__dataclass_fields__} for row in top]
    record: dict[str, Any] = {
        "model": model,
        "world": world,
        "labels": [row_label(r.candidate) for r in top],
        "predicted": [r.step.step_s for r in top],
        "terms": [_terms(r.step) for r in top],
    }
    with tempfile.TemporaryDirectory() as out:
        try:
            spawn(_rank, world, model, fields, out, timeout=900)
        except AssertionError as failure:
            lines = [line for line in str(failure).splitlines() if line.strip()]
            return record | {"error": lines[-1] if lines else "failed"}
        rounds = json.loads(Path(out, "times.json").read_text())
    record["rounds"] = [rounds[str(i)] for i in range(len(top))]
    return record


def _terms(step: Any) -> dict[str, float]:
    """Where the predicted time goes (seconds)."""
    return {
        "compute": step.compute_s,
        "dispatch": step.dispatch_s,
        "plugin": step.plugin_s,
        "optimizer_tensors": step.optimizer_overhead_s,
        "optimizer": step.optimizer_s,
        "communication": sum(step.communication_s.values()),
        "bubble": step.bubble_s,
    }


def section(records: list[dict[str, Any]]) -> str:
    lines = [
        "| model | ranks | predicted order (ms) | measured median ± spread (ms), in predicted order | strict | "
        "within noise |",
        "|---|---|---|---|---|---|",
    ]
    strict = noisy = groups = 0
    for r in records:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r['world']} | {'; '.join(r['labels'])} | failed: {r['error'][:80]} | | |")
            continue
        timings = {label: timing(rounds) for label, rounds in zip(r["labels"], r["rounds"], strict=True)}
        agreed = agreement(r["labels"], timings)
        strict, noisy, groups = strict + agreed.strict, noisy + agreed.within_noise, groups + 1
        predicted = "; ".join(f"{label} ({p * 1e3:.1f})" for label, p in zip(r["labels"], r["predicted"], strict=True))
        measured = "; ".join(_shown(timings[label]) for label in r["labels"])
        lines.append(f"| {r['model']} | {r['world']} | {predicted} | {measured} | "
                     f"{'yes' if agreed.strict else 'no'} | {'yes' if agreed.within_noise else 'no'} |")  # fmt: skip
    lines += ["", f"Top-3 order agrees strictly in {strict} of {groups} groups, within noise in {noisy} of {groups}."]
    return "\n".join(lines)


def _shown(t: Timing) -> str:
    return f"{t.median * 1e3:.1f} ± {t.spread * 1e3:.1f}"


if __name__ == "__main__":
    done = [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
    if not os.environ.get("CX_BENCH_REPORT_ONLY"):
        wanted = [(m, int(w)) for m, w in (arg.split(":") for arg in sys.argv[1:])] or GROUPS
        for model, world in wanted:
            print(f"{model} x{world} ...", file=sys.stderr, flush=True)
            record = measure_group(model, world)
            print(json.dumps(record), file=sys.stderr, flush=True)
            done = [r for r in done if (r["model"], r["world"]) != (model, world)] + [record]
            RESULTS.write_text("".join(json.dumps(r) + "\n" for r in done))
    order = {group: i for i, group in enumerate(GROUPS)}
    print(section(sorted(done, key=lambda r: order.get((r["model"], r["world"]), 99))))
