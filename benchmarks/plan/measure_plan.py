"""cx-plan's predictions against measurement on this CPU, over models, plugins and layouts; writes RESULTS.md.

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .nox/tests/bin/python benchmarks/plan/measure_plan.py`
(`CX_BENCH_SMOKE=1`: one model, one world; `CX_BENCH_REPORT_ONLY=1`: rewrite RESULTS.md from the stored results;
`CX_BENCH_REMEASURE=<plugin>`: measure that plugin's stored rows again). For cx's GPT and the tiny HF Llama / Mixtral /
DeepSeek-V3 presets of cx-train (hidden 64, 2 layers, seq 32, fp32) on 1, 2 and 4 ranks, cx-plan ranks every candidate
(`plan` with the traced memory model, the `cpu` device); the measured set is the top 3 by predicted step time plus each
other plugin's best, each run through `cx_plugins.plan._measure.measure_candidate` (a warm-up step, then STEPS steps;
peak of the live tensor storages per rank). Results stream to `results.jsonl` beside this file (a rerun resumes);
RESULTS.md is rewritten from them with the predicted peaks recomputed by the memory model as it is now, followed by the
hand-written `notes.md`.
No assertion: this is a report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from cx_plugins.plan import SearchSpace, load_model_shape, plan, predict_memory
from cx_plugins.plan._devices import lookup_device
from cx_plugins.plan._enumerate import enumerate_candidates
from cx_plugins.plan._measure import measure_candidate
from cx_plugins.plan._planner import traced_memory_model
from cx_plugins.plan._report import PlanRow, row_label

HIDDEN, LAYERS, SEQ, STEPS = 64, 2, 32, 2
RUNS = {"gpt": (1, 2, 4), "llama": (1, 2, 4), "mixtral": (2, 4), "deepseek_v3": (2, 4)}
if os.environ.get("CX_BENCH_SMOKE"):
    RUNS = {"gpt": (2,)}
HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.jsonl"
_TOLERANCE = 0.10


def _chosen(rows: list[PlanRow]) -> list[PlanRow]:
    """The top 3 by predicted step time, then each other plugin's best (one layout per plugin)."""
    fitting = [row for row in rows if row.memory.fits]
    chosen = fitting[:3]
    for row in fitting:
        if row.candidate.plugin not in {c.candidate.plugin for c in chosen}:
            chosen.append(row)
    return chosen


def _record(model: str, world: int, top: int, row: PlanRow) -> dict[str, Any]:
    measured = measure_candidate(row.candidate, model, hidden=HIDDEN, layers=LAYERS, seq_len=SEQ, steps=STEPS)
    return {
        "model": model,
        "world": world,
        "label": row_label(row.candidate),
        "top": top,
        "predicted_peak": row.memory.peak_bytes,
        "predicted_step_s": row.step.step_s,
        "peaks": measured.peaks,
        "rss": measured.rss,
        "step_s": measured.step_s,
        "error": measured.error,
    }


def measure_all() -> list[dict[str, Any]]:
    done = [json.loads(line) for line in RESULTS.read_text().splitlines()] if RESULTS.exists() else []
    seen = {(r["model"], r["world"], r["label"]) for r in done}
    device = lookup_device("cpu")
    for model, worlds in RUNS.items():
        shape = load_model_shape(model, hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
        for world in worlds:
            space = SearchSpace(global_batch=2 * world, checkpoint_ratios=(0.0,), precision="fp32")
            report = plan(shape, world, SEQ, device, traced_memory_model(shape, SEQ, device), space=space)
            for top, row in enumerate(_chosen(report.rows), 1):
                if (model, world, row_label(row.candidate)) in seen:
                    continue
                print(f"{model} x{world}: {row_label(row.candidate)}", file=sys.stderr, flush=True)
                record = _record(model, world, top if top <= 3 else 0, row)
                done.append(record)
                with RESULTS.open("a") as out:
                    out.write(json.dumps(record) + "\n")
    return done


def _remeasure(records: list[dict[str, Any]], plugin: str) -> None:
    """Measure the stored rows of `plugin` again, in place (after a fix to the measurement itself), and rewrite
    results.jsonl; the other rows and which rows were chosen stay as they were."""
    for model, worlds in RUNS.items():
        shape = load_model_shape(model, hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
        for world in worlds:
            space = SearchSpace(global_batch=2 * world, checkpoint_ratios=(0.0,), precision="fp32")
            by_label = {row_label(c): c for c in enumerate_candidates(shape, world, SEQ, space)}
            for record in records:
                if (record["model"], record["world"]) != (model, world) or record["label"].split()[0] != plugin:
                    continue
                print(f"{model} x{world}: {record['label']} (again)", file=sys.stderr, flush=True)
                measured = measure_candidate(by_label[record["label"]], model, hidden=HIDDEN, layers=LAYERS,
                                             seq_len=SEQ, steps=STEPS)  # fmt: skip
                record.update(peaks=measured.peaks, rss=measured.rss, step_s=measured.step_s, error=measured.error)
                RESULTS.write_text("".join(json.dumps(r) + "\n" for r in records))


def _repredict(records: list[dict[str, Any]]) -> None:
    """The predicted peak of each record by the memory model as it is now (the candidates found again by label), so
    RESULTS.md follows changes to the model without re-measuring."""
    for model, worlds in RUNS.items():
        shape = load_model_shape(model, hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
        for world in worlds:
            space = SearchSpace(global_batch=2 * world, checkpoint_ratios=(0.0,), precision="fp32")
            by_label = {row_label(c): c for c in enumerate_candidates(shape, world, SEQ, space)}
            for record in records:
                if record["model"] == model and record["world"] == world and record["label"] in by_label:
                    try:
                        candidate = by_label[record["label"]]  # measured on the CPU: offloaded states count
                        record["predicted_peak"] = predict_memory(shape, candidate, SEQ, host_is_device=True).peak
                    except Exception as error:  # reported in the row, not raised
                        record["error"] = record["error"] or f"prediction failed: {error}"


def _order(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: values[i])


def write_results(records: list[dict[str, Any]]) -> str:
    lines = [
        "# cx-plan: predicted vs measured on this CPU",
        "",
        f"Generated by `benchmarks/plan/measure_plan.py` (hidden {HIDDEN}, {LAYERS} layers, seq {SEQ}, fp32, global "
        "batch 2 per rank, torch AdamW; a warm-up step then "
        f"{STEPS} measured steps; 2-core machine shared with other jobs). Memory: the peak of live tensor storages on "
        "the busiest rank (`LiveBytes`, every storage any op writes, from before the model is built). `top`: the "
        "place by predicted step time (0: a plugin's best outside the top 3). Error = (predicted - measured) / "
        "measured.",
        "",
        "| model | ranks | configuration | top | predicted MB | measured MB | error | within 10% | pred ms | meas ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    within = total = 0
    for r in records:
        if r["error"]:
            lines.append(f"| {r['model']} | {r['world']} | {r['label']} | {r['top']} | "
                         f"{r['predicted_peak'] / 1e6:.3f} | failed: {r['error'][:80]} | | | | |")  # fmt: skip
            continue
        peak = max(r["peaks"])
        error = (r["predicted_peak"] - peak) / peak
        ok = abs(error) <= _TOLERANCE
        within, total = within + ok, total + 1
        lines.append(
            f"| {r['model']} | {r['world']} | {r['label']} | {r['top']} | {r['predicted_peak'] / 1e6:.3f} | "
            f"{peak / 1e6:.3f} | {error:+.1%} | {'yes' if ok else 'no'} | {r['predicted_step_s'] * 1e3:.1f} | "
            f"{r['step_s'] * 1e3:.1f} |"
        )
    lines += ["", f"Within 10%: {within} of {total} measured configurations.", "", "## Ranking of the top 3", ""]
    lines += ["| model | ranks | predicted order (ms) | measured order (ms) | agree |", "|---|---|---|---|---|"]
    agree = groups = 0
    for model, worlds in RUNS.items():
        for world in worlds:
            top = sorted((r for r in records if r["model"] == model and r["world"] == world and r["top"] and
                          not r["error"]), key=lambda r: r["top"])  # fmt: skip
            if len(top) < 2:
                continue
            predicted = [f"{r['label']} ({r['predicted_step_s'] * 1e3:.1f})" for r in top]
            by_time = [top[i] for i in _order([r["step_s"] for r in top])]
            measured = [f"{r['label']} ({r['step_s'] * 1e3:.1f})" for r in by_time]
            same = [r["label"] for r in top] == [r["label"] for r in by_time]
            agree, groups = agree + same, groups + 1
            lines.append(f"| {model} | {world} | {'; '.join(predicted)} | {'; '.join(measured)} | "
                         f"{'yes' if same else 'no'} |")  # fmt: skip
    lines += ["", f"Top-3 order agrees in {agree} of {groups} (model, ranks) groups.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if os.environ.get("CX_BENCH_REPORT_ONLY"):  # rewrite RESULTS.md from results.jsonl, measuring nothing
        records = [json.loads(line) for line in RESULTS.read_text().splitlines()]
    elif os.environ.get("CX_BENCH_REMEASURE"):  # a plugin's stored rows measured again, e.g. torch_fsdp
        records = [json.loads(line) for line in RESULTS.read_text().splitlines()]
        _remeasure(records, os.environ["CX_BENCH_REMEASURE"])
    else:
        records = measure_all()
    _repredict(records)
    text = write_results(records)
    if not os.environ.get("CX_BENCH_SMOKE"):
        (HERE / "RESULTS.md").write_text(text + (HERE / "notes.md").read_text() if (HERE / "notes.md").exists()
                                         else text)  # fmt: skip
    print(text)
