"""fp8 vs bf16: bytes and time of cx_mesh's four flat collectives, and fp8_linear vs F.linear in bf16.

Collectives (2 ranks, gloo on CPU; NCCL when 2 GPUs are present and --nccl is given): for each of all-gather,
reduce-scatter (SUM), all-reduce (SUM) and all-to-all, at a few sizes (elements per rank of a bf16 tensor), the bf16
collective (`cx_mesh.all_gather_flat`, `reduce_scatter_flat`, `all_reduce`, `all_to_all_single`) against its fp8
counterpart (`cx_mesh.fp8.*_fp8`: quantize, exchange as uint8, dequantize/sum): bytes this rank hands to
torch.distributed (`cx_mesh.testing.count_collective_bytes`) and the median wall time per call, between barriers.
Matmul (one process): fp8_linear (both recipes) and, when torchao is installed, torchao's Float8Linear, against
F.linear in bf16, forward and forward + backward, on CPU and on CUDA when available. Ratios are fp8 / bf16.

    OMP_NUM_THREADS=1 python benchmarks/fp8/bench_fp8.py [--reps 10] [--sizes 65536 1048576 4194304]
Writes benchmarks/fp8/RESULTS.md (the tables; the discussion there is edited by hand, between the markers).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cx_mesh import all_gather_flat, all_reduce, all_to_all_single, reduce_scatter_flat
from cx_mesh.fp8 import (
    ScalingRecipe,
    all_gather_flat_fp8,
    all_reduce_fp8,
    all_to_all_single_fp8,
    fp8_linear,
    fp8_matmul_supported,
    reduce_scatter_flat_fp8,
)
from cx_mesh.testing import count_collective_bytes, spawn

_Call = Callable[[], object]
_TORCHAO_CPU_MAX = 256**3


def _median_ms(call: _Call, reps: int, sync: Callable[[], None]) -> float:
    call()  # warm-up
    sync()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def _collective_calls(numel: int, world: int, device: torch.device) -> dict[str, tuple[_Call, _Call]]:
    """name -> (bf16 call, fp8 call), each on fresh-looking buffers of numel bf16 elements per rank."""
    x = torch.randn(numel, device=device).bfloat16()
    gathered = torch.empty(numel * world, dtype=torch.bfloat16, device=device)
    big = torch.randn(numel * world, device=device).bfloat16()
    scattered = torch.empty(numel, dtype=torch.bfloat16, device=device)
    reduced = x.clone()
    exchanged = torch.empty(numel, dtype=torch.bfloat16, device=device)
    rows = x.view(-1, 64)
    exchanged_rows = exchanged.view(-1, 64)
    return {
        "all-gather": (
            lambda: all_gather_flat(gathered, x),
            lambda: all_gather_flat_fp8(gathered, x),
        ),
        "reduce-scatter": (
            lambda: reduce_scatter_flat(scattered, big),
            lambda: reduce_scatter_flat_fp8(scattered, big),
        ),
        "all-reduce": (lambda: all_reduce(reduced), lambda: all_reduce_fp8(reduced)),
        "all-to-all": (
            lambda: all_to_all_single(exchanged_rows, rows),
            lambda: all_to_all_single_fp8(exchanged_rows, rows),
        ),
    }


def _cuda_barrier() -> None:
    torch.cuda.synchronize()
    dist.barrier()


def _collectives_worker(rank: int, world: int, sizes: list[int], reps: int, out: str) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    sync = _cuda_barrier if device.type == "cuda" else dist.barrier
    rows = []
    for numel in sizes:
        for name, (bf16_call, fp8_call) in _collective_calls(numel, world, device).items():
            measured: dict[str, Any] = {"collective": name, "numel": numel, "backend": dist.get_backend()}
            for label, call in (("bf16", bf16_call), ("fp8", fp8_call)):
                with count_collective_bytes() as counted:
                    call()
                measured[f"{label}_bytes"] = counted.total
                measured[f"{label}_ms"] = _median_ms(call, reps, sync)
            rows.append(measured)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


_Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _time_linear(
    fn: _Linear, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, reps: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """Median ms of the forward alone and of forward + backward."""
    forward = _median_ms(lambda: fn(x, w), reps, sync)
    both = _median_ms(lambda: fn(x, w).backward(g), reps, sync)
    return forward, both


def _no_sync() -> None:
    pass


def _linear_variants(w: torch.Tensor, device: torch.device, small: bool) -> dict[str, _Linear]:
    variants: dict[str, _Linear] = {
        "bf16 F.linear": lambda a, b: F.linear(a, b),
        "fp8_linear tensorwise": lambda a, b: fp8_linear(a, b),
        "fp8_linear rowwise": lambda a, b: fp8_linear(a, b, recipe=ScalingRecipe.ROWWISE),
    }
    # torchao's tensorwise GEMM takes scalar scales, which torch's CPU kernel runs ~500x slower than per-row ones
    # (cx passes them per row there): on CPU it is timed on the small shapes only
    layer = _torchao_linear(w, device) if device.type == "cuda" or small else None
    if layer is not None:
        variants["torchao Float8Linear"] = lambda a, b: layer(a)
    return variants


def _linear_rows(device: torch.device, shapes: list[tuple[int, ...]], reps: int) -> list[dict[str, Any]]:
    sync = torch.cuda.synchronize if device.type == "cuda" else _no_sync
    rows = []
    for tokens, k, n in shapes:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, k, generator=generator).bfloat16().to(device).requires_grad_()
        w = (torch.randn(n, k, generator=generator) / k**0.5).bfloat16().to(device).requires_grad_()
        g = torch.randn(tokens, n, generator=generator).bfloat16().to(device)
        for name, fn in _linear_variants(w, device, tokens * k * n <= _TORCHAO_CPU_MAX).items():
            forward, both = _time_linear(fn, x, w, g, reps, sync)
            row = {"device": str(device), "shape": f"{tokens}x{k}x{n}", "variant": name}
            rows.append(row | {"forward_ms": forward, "fwd_bwd_ms": both})
    return rows


def _torchao_linear(weight: torch.Tensor, device: torch.device) -> torch.nn.Module | None:
    """torchao's Float8Linear (tensorwise, dynamic) with the same weight, when torchao is installed."""
    try:  # through importlib: torchao is an optional extra, absent from the typecheck venv
        convert_to_float8_training = importlib.import_module("torchao.float8").convert_to_float8_training
    except ImportError:
        return None
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
    holder = torch.nn.Sequential(layer)
    convert_to_float8_training(holder)
    return holder


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> list[str]:
    lines = ["| " + " | ".join(title for title, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(**row) for _, fmt in columns) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 16, 1 << 20, 1 << 22])
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["256x256x256", "1024x1024x1024"],
        help="tokens x in_features x out_features of the matmul",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--nccl", action="store_true", help="also run the collectives on NCCL (2 GPUs)")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    collective_rows: list[dict[str, Any]] = []
    backends = ["gloo"] + (["nccl"] if args.nccl and torch.cuda.device_count() >= 2 else [])
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            spawn(_collectives_worker, 2, args.sizes, args.reps, out, backend=backend, timeout=1200)
            collective_rows += json.loads(Path(out).read_text())
    for row in collective_rows:
        row["bytes_ratio"] = row["fp8_bytes"] / row["bf16_bytes"]
        row["time_ratio"] = row["fp8_ms"] / row["bf16_ms"]
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if fp8_matmul_supported("cuda") else [])
    linear_rows = [row for device in devices for row in _linear_rows(device, shapes, args.reps)]
    baseline = {(r["device"], r["shape"]): r for r in linear_rows if r["variant"] == "bf16 F.linear"}
    for row in linear_rows:
        base = baseline[(row["device"], row["shape"])]
        row["forward_ratio"] = row["forward_ms"] / base["forward_ms"]
        row["fwd_bwd_ratio"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    print(json.dumps({"collectives": collective_rows, "linear": linear_rows}), file=sys.stderr)
    tables = [
        f"<!-- tables: `{' '.join(['python benchmarks/fp8/bench_fp8.py', *sys.argv[1:]])}`, torch {torch.__version__},"
        f" {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} -->",
        "",
        "### Collectives (2 ranks; per call, this rank)",
        "",
        *_table(
            collective_rows,
            [
                ("backend", "{backend}"),
                ("collective", "{collective}"),
                ("bf16 elements / rank", "{numel}"),
                ("bf16 bytes", "{bf16_bytes}"),
                ("fp8 bytes", "{fp8_bytes}"),
                ("bytes fp8/bf16", "{bytes_ratio:.4f}"),
                ("bf16 ms", "{bf16_ms:.2f}"),
                ("fp8 ms", "{fp8_ms:.2f}"),
                ("time fp8/bf16", "{time_ratio:.2f}"),
            ],
        ),
        "",
        "### Linear (one process, bf16 activations and weights)",
        "",
        *_table(
            linear_rows,
            [
                ("device", "{device}"),
                ("tokens x in x out", "{shape}"),
                ("variant", "{variant}"),
                ("forward ms", "{forward_ms:.2f}"),
                ("fwd+bwd ms", "{fwd_bwd_ms:.2f}"),
                ("forward / bf16", "{forward_ratio:.2f}"),
                ("fwd+bwd / bf16", "{fwd_bwd_ratio:.2f}"),
            ],
        ),
        "<!-- end tables -->",
    ]
    text = args.results.read_text() if args.results.exists() else "# fp8 benchmark\n\n<!-- end tables -->\n"
    start = "<!-- tables:" if "<!-- tables:" in text else "<!-- end tables -->"
    head, tail = text.split(start, 1)[0], text.split("<!-- end tables -->", 1)[1]
    args.results.write_text(head + "\n".join(tables) + tail)


if __name__ == "__main__":
    main()
