"""Where a cx training step's time goes: compute, communication and host work, per plugin mode (issue 37).

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .nox/tests/bin/python
benchmarks/profile/profile_steps.py [mode ...]` (a few minutes; `CX_BENCH_SMOKE=1` for a seconds-long check).
Modes are those of the step benchmarks, built by their own harnesses so the models and settings are theirs: hybrid
tp 2, hybrid pp 2 1F1B (even, and `num_layers_per_stage="balanced"`), hybrid pp 2 interleaved (benchmarks/hybrid),
MoeHybrid ep 2 zero 1 on the dense-heavy Mixtral (benchmarks/moe_hybrid), LowLevelZero stage 2 (benchmarks/zero),
Gemini bf16 and its peer FSDP2 bf16 (benchmarks/gemini); 2 gloo ranks, one thread each.

For each mode, on each rank, after warm-up steps:
- wall: median of unprofiled steps (between barriers, as the harnesses time them);
- compute: self time of the `aten::` operators on the step's thread under `torch.profiler` (on CPU the kernels run
  on that thread);
- communication: self time of the `c10d::` / gloo operators and waits on that thread (the time a rank is blocked in a
  collective or point-to-point call, waiting for its peer included);
- waiting: time blocked in `Work.wait` (asynchronous collectives and point-to-point receives, pipeline bubbles
  included), from cProfile;
- host: wall - compute - communication - waiting: Python, hooks, bookkeeping, the dispatcher (measured against the
  unprofiled wall, so the profilers' own overhead is not counted);
- one process's compute share: for the hybrid modes, the compute of one process training the same model on the same
  batch, halved (what a perfect 2-rank split would leave each rank);
- the cx Python functions with the most own time under cProfile over the same steps (where the host work is).
"""

from __future__ import annotations

import cProfile
import importlib
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh.testing import spawn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: bench_models, bench_timing
SMOKE = bool(os.environ.get("CX_BENCH_SMOKE"))
WARMUP, TIMED, PROFILED = (1, 2, 1) if SMOKE else (2, 6, 3)
COMM_PREFIXES = ("c10d::", "gloo:", "nccl:", "record_param_comms")
COMM_WORDS = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast", "barrier",
              "all_to_all", "alltoall", "send", "recv")  # fmt: skip

Step = Callable[[int], object]


def _harness(folder: str, module: str) -> Any:
    """A step benchmark's module (its builders), imported from its folder."""
    sys.path.insert(0, str(HERE.parent / folder))
    return importlib.import_module(module)


def _hybrid(**options: Any) -> Callable[[int], Step]:
    def build(rank: int) -> Step:
        bench = _harness("hybrid", "bench_hybrid")
        step, _ = bench._cx(**options)
        return lambda i: step(bench._batch(i))

    return build


def _hybrid_single(rank: int) -> Step:
    bench = _harness("hybrid", "bench_hybrid")
    step, _ = bench._single(rank)
    return lambda i: step(bench._batch(i))


def _moe_hybrid(rank: int) -> Step:
    bench = _harness("moe_hybrid", "bench_moe_hybrid")
    shape = bench.SHAPES[0]
    system = bench._cx(shape, 1)

    def step(i: int) -> None:
        system.train(bench._rows(i, rank, shape.vocab))
        system.clear()

    return step


def _low_level_zero(rank: int) -> Step:
    bench = _harness("zero", "bench_low_level_zero")
    from cx_zero import LowLevelZeroOptimizer

    torch.manual_seed(0)
    model = bench.GPT()
    zero = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-4), partition_grad=True, overlap_communication=True
    )
    generator = torch.Generator().manual_seed(rank)

    def step(i: int) -> None:
        tokens = torch.randint(0, bench.VOCAB, (bench.BATCH, bench.SEQ), generator=generator)
        zero.zero_grad()
        zero.backward(bench._loss(model, tokens))
        zero.step()

    return step


def _gemini(rank: int) -> Step:
    bench = _harness("gemini", "bench_gemini")
    gemini_step, _ = bench._gemini(torch.bfloat16, offload=False)
    generator = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, bench.VOCAB, (bench.BATCH, bench.SEQ + 1), generator=generator) for _ in range(4)]

    def step(i: int) -> None:
        batch = data[i % len(data)]
        gemini_step(batch[:, :-1], batch[:, 1:])

    return step


def _fsdp2(rank: int) -> Step:
    """Gemini bf16's peer on the same model and batches (the benchmark's FSDP2 bf16)."""
    bench = _harness("gemini", "bench_gemini")
    fsdp_step = bench._fsdp(torch.bfloat16, offload=False)
    generator = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, bench.VOCAB, (bench.BATCH, bench.SEQ + 1), generator=generator) for _ in range(4)]

    def step(i: int) -> None:
        batch = data[i % len(data)]
        fsdp_step(batch[:, :-1], batch[:, 1:])

    return step


MODES: dict[str, Callable[[int], Step]] = {
    "hybrid tp 2": _hybrid(tp_size=2, pp_size=1),
    "hybrid pp 2 1F1B": _hybrid(tp_size=1, pp_size=2, num_microbatches=4),
    "hybrid pp 2 1F1B balanced": _hybrid(tp_size=1, pp_size=2, num_microbatches=4, num_layers_per_stage="balanced"),
    "hybrid pp 2 interleaved": _hybrid(
        tp_size=1, pp_size=2, num_microbatches=4, pp_style="interleaved", num_model_chunks=2
    ),
    "MoeHybrid ep 2 zero 1": _moe_hybrid,
    "LowLevelZero stage 2": _low_level_zero,
    "Gemini bf16": _gemini,
    "FSDP2 bf16": _fsdp2,
}
SINGLE: dict[str, Callable[[int], Step]] = {"hybrid": _hybrid_single}  # one process's compute, for the share


def _is_comm(name: str) -> bool:
    """A c10d / gloo operator (an `aten::` one, e.g. broadcast_tensors, is compute; waits are counted by cProfile)."""
    lowered = name.lower()
    if lowered.startswith("aten::") or "wait" in lowered:
        return False
    return lowered.startswith(COMM_PREFIXES) or any(word in lowered for word in COMM_WORDS)


def _wall(step: Step, first: int) -> float:
    """Median ms of unprofiled steps, each between barriers."""
    times = []
    for i in range(first, first + TIMED):
        dist.barrier()
        start = time.perf_counter()
        step(i)
        dist.barrier()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _split(step: Step, first: int) -> dict[str, float]:
    """ms per step of compute and communication on the step's thread, from torch.profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(first, first + PROFILED):
            dist.barrier()
            with torch.profiler.record_function("cx_profile_step"):
                step(i)
            dist.barrier()
    events = prof.events()
    marker = next(e for e in events if e.name == "cx_profile_step")
    mine = [e for e in events if e.thread == marker.thread and e.name != "cx_profile_step"]
    comm = sum(e.self_cpu_time_total for e in mine if _is_comm(e.name))
    compute = sum(e.self_cpu_time_total for e in mine if e.name.startswith("aten::"))
    return {"compute": compute / 1e3 / PROFILED, "communication": comm / 1e3 / PROFILED}


def _python_profile(step: Step, first: int, top: int = 6) -> tuple[float, list[tuple[str, float]]]:
    """From cProfile over the same kind of steps: ms per step blocked in `Work.wait` (asynchronous collectives and
    point-to-point receives finish there, outside any operator the torch profiler sees), and the cx functions with
    the most own time (ms per step)."""
    profiler = cProfile.Profile()
    for i in range(first, first + PROFILED):
        dist.barrier()
        profiler.enable()
        step(i)
        profiler.disable()
        dist.barrier()
    stats = pstats.Stats(profiler)
    rows: list[tuple[str, float]] = []
    waiting = 0.0
    for (path, line, function), (_, _, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "/cx_" in path:
            rows.append((f"{path.split('/src/')[-1]}:{line} {function}", own * 1e3 / PROFILED))
        elif path == "~" and ("'wait' of" in function or "_distributed_c10d.wait" in function):
            waiting += cumulative * 1e3 / PROFILED
    return waiting, sorted(rows, key=lambda row: -row[1])[:top]


def _measure(step: Step) -> dict[str, Any]:
    for i in range(WARMUP):
        step(i)
    wall = _wall(step, WARMUP)
    split = _split(step, WARMUP + TIMED)
    waiting, hot = _python_profile(step, WARMUP + TIMED + PROFILED)
    host = max(0.0, wall - split["compute"] - split["communication"] - waiting)
    return {"wall": wall, **split, "waiting": waiting, "host": host, "python_hot": hot}


def _worker(rank: int, world_size: int, modes: list[str], out: str) -> None:
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    single = _measure(SINGLE["hybrid"](rank)) if any(m.startswith("hybrid") for m in modes) else None
    for mode in modes:
        results[mode] = _measure(MODES[mode](rank))
        if mode.startswith("hybrid") and single is not None:
            results[mode]["one_process_share"] = single["compute"] / world_size
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, results)
    if rank == 0:
        Path(out).write_text(json.dumps({"load": os.getloadavg()[0], "ranks": gathered}))


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    smoke_skips = ("hybrid pp 2 interleaved",) if SMOKE else ()  # the smoke Llama has 2 layers, fewer than 4 chunks
    modes = sys.argv[1:] or [mode for mode in MODES if mode not in smoke_skips]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "profile.json")
        spawn(_worker, 2, modes, path, timeout=1800)
        results = json.loads(Path(path).read_text())
    print(f"load average at the end {results['load']:.1f}; ms per step")
    header = "| mode | rank | wall | compute | in collectives | waiting on async work | host |"
    print(header + " one process's compute / 2 |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in modes:
        for rank, by_mode in enumerate(results["ranks"]):
            r = by_mode[mode]
            first = results["ranks"][0][mode]  # one process ran on rank 0
            share = f"{first['one_process_share']:.0f}" if "one_process_share" in first else "-"
            parts = " | ".join(f"{r[key]:.0f}" for key in ("wall", "compute", "communication", "waiting", "host"))
            print(f"| {mode} | {rank} | {parts} | {share} |")
    for mode in modes:
        for rank, by_mode in enumerate(results["ranks"]):
            print(f"\n{mode}, rank {rank}: cx functions with the most own time under cProfile (ms per step, inflated)")
            for name, ms in by_mode[mode]["python_hot"]:
                print(f"  {ms:7.2f}  {name}")


if __name__ == "__main__":
    main()
