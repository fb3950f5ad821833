"""What cx-mesh's collective log costs: small `cx_mesh.all_reduce` calls with recording on and off, side by side.

Every collective cx-mesh issues is recorded in a per-process ring (`record_collective`: group, sequence number, kind,
size), so that a timeout can say which rank is behind. This measures whether that is cheap enough to leave on. Per
rank count (1 and 2 ranks, gloo, CPU) the variants take turns in blocks, between barriers, so machine noise hits them
alike (each variant goes first in turn): `cx_mesh.all_reduce` of a 4-element tensor with recording on, the same
with it off, and torch's own `dist.all_reduce` for reference. Reported: microseconds per call (total over all
blocks), the ratio on / off (totals, and the median of the blocks' paired ratios), and `record_collective` alone.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mesh/bench_collective_log.py [--calls 10000] [--repeats 3]
Writes benchmarks/mesh/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from cx_mesh import all_reduce, record_collective, set_collective_recording
from cx_mesh.testing import spawn

VARIANTS = ("recording on", "recording off", "torch dist.all_reduce")


def _block(call: Callable[[], object], count: int) -> float:
    """Seconds for `count` calls, started and ended together on every rank."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(count):
        call()
    dist.barrier()
    return time.perf_counter() - start


def _worker(rank: int, world: int, calls: int, block: int, out: str) -> None:
    tensor = torch.ones(4)

    def cx_call() -> None:
        all_reduce(tensor)

    def torch_call() -> None:
        dist.all_reduce(tensor)

    for _ in range(200):  # warm-up: gloo's pairs and the log's dict entries exist before timing
        cx_call()
        torch_call()
    seconds: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for turn in range(calls // block):
        for index in range(len(VARIANTS)):
            name = VARIANTS[(turn + index) % len(VARIANTS)]  # each variant goes first in turn: no order bias
            set_collective_recording(name != "recording off")
            seconds[name].append(_block(torch_call if name == "torch dist.all_reduce" else cx_call, block))
    set_collective_recording(True)
    start = time.perf_counter()
    for _ in range(calls):
        record_collective("all-reduce", None, tensor)
    record_alone = time.perf_counter() - start
    if rank == 0:
        result = {
            "world": world,
            "us": {name: 1e6 * sum(times) / (len(times) * block) for name, times in seconds.items()},
            "paired": statistics.median(
                on / off for on, off in zip(seconds["recording on"], seconds["recording off"], strict=True)
            ),
            "record_us": 1e6 * record_alone / calls,
        }
        Path(out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10_000, help="calls per variant and rank count")
    parser.add_argument("--block", type=int, default=100, help="calls per turn")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="runs of every rank count, one table row each")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    rows = []
    for _ in range(args.repeats):
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                spawn(_worker, world, args.calls, args.block, out, timeout=1200)
                rows.append(json.loads(Path(out).read_text()))
            print(json.dumps(rows[-1]), file=sys.stderr)
    lines = [
        "# cx-mesh benchmark: the collective log's cost",
        "",
        f"`OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mesh/bench_collective_log.py --calls {args.calls} "
        f"--block {args.block} --repeats {args.repeats}` (gloo, CPU, {os.cpu_count()} cores shared with other work, "
        f"torch {torch.__version__}). {args.calls} calls per variant, all-reducing a 4-element float32 tensor over the "
        f"default group, in turns of {args.block} calls between barriers.",
        "",
        "| ranks | cx all_reduce, recording on (us/call) | recording off (us/call) | torch dist.all_reduce (us/call) | "
        "on / off (total) | on / off (median of paired blocks) | record_collective alone (us/call) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        us = row["us"]
        lines.append(
            f"| {row['world']} | {us['recording on']:.1f} | {us['recording off']:.1f} | "
            f"{us['torch dist.all_reduce']:.1f} | {us['recording on'] / us['recording off']:.3f} | "
            f"{row['paired']:.3f} | {row['record_us']:.2f} |"
        )
    lines += [
        "",
        "Recording is a tuple appended to a 16-entry deque and one dict entry per collective, with no store traffic;",
        "the store is written only when a wait outlasts its first one-second poll slice, or a collective fails.",
        "On a shared machine the on / off ratios move by several percent between runs, more than the record costs",
        "alone (last column): read them together with it. One rank is the worst case (the cheapest collective);",
        "with two ranks a collective costs 10-20x more and the record the same.",
    ]
    args.results.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
