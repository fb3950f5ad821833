"""cx-moe's fp8 switches on one expert-parallel MoE layer: bytes each rank hands to the all-to-alls and step time,
bf16 vs use_fp8 vs fp8_communication vs both, 2 processes, CPU, gloo.

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo .nox/tests/bin/python benchmarks/moe/bench_moe_fp8.py` (about a
minute on 2 cores; `CX_BENCH_SMOKE=1` for a seconds-long check). A `MoeLayer` (hidden 256, 8 experts of intermediate
512, top-2, 1024 tokens per rank, bf16 parameters and activations) split over ep 2; one step is forward + backward.
The four variants take turns step by step in one pair of processes, so machine noise hits all alike; medians are
printed as a Markdown table. Bytes are the first step's `count_collective_bytes` for `all_to_all_single` (the count
exchange included), exact; times are this machine's (no fp8 hardware on a CPU: see benchmarks/fp8/RESULTS.md).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import count_collective_bytes, spawn
from cx_moe import ExpertOptions, MoeFp8Options, MoeLayer, RouterOptions

SMOKE = os.environ.get("CX_BENCH_SMOKE") == "1"
HIDDEN, INTER, EXPERTS, TOKENS = (32, 32, 4, 64) if SMOKE else (256, 512, 8, 1024)
STEPS = 3 if SMOKE else 15
VARIANTS = {
    "bf16": None,
    "use_fp8": MoeFp8Options(use_fp8=True),
    "fp8_communication": MoeFp8Options(fp8_communication=True),
    "both": MoeFp8Options(use_fp8=True, fp8_communication=True),
}


def _worker(rank: int, world_size: int, out: str) -> None:
    mesh = ProcessGroupMesh(1, world_size, axis_names=("moe_dp", "ep"))
    ep, moe_dp = mesh.get_group_along_axis("ep"), mesh.get_group_along_axis("moe_dp")
    layers = {}
    for name, fp8 in VARIANTS.items():
        torch.manual_seed(0)
        layers[name] = MoeLayer(
            ExpertOptions(HIDDEN, INTER),
            RouterOptions(num_experts=EXPERTS, top_k=2),
            ep_group=ep,
            moe_dp_group=moe_dp,
            dtype=torch.bfloat16,
            fp8=fp8,
        )
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    moved: dict[str, int] = {}
    for step in range(STEPS + 1):
        for name, layer in layers.items():
            inputs = x.clone().requires_grad_(True)
            dist.barrier()
            start = time.perf_counter()
            with count_collective_bytes() as counted:
                layer(inputs).float().square().mean().backward()
            dist.barrier()
            if step == 0:  # warm-up step: bytes only
                moved[name] = counted.by_op.get("all_to_all_single", 0)
            else:
                times[name].append((time.perf_counter() - start) * 1e3)
    if rank == 0:
        result = {name: (moved[name], statistics.median(times[name])) for name in VARIANTS}
        Path(out).write_text(json.dumps(result))


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "result.json")
        spawn(_worker, 2, path, timeout=1200)
        result: dict[str, list[float]] = json.loads(Path(path).read_text())
    bf16_bytes, bf16_ms = result["bf16"]
    print(f"MoeLayer hidden {HIDDEN}, {EXPERTS} experts of {INTER}, top-2, {TOKENS} tokens/rank, bf16, ep 2 (rank 0)")
    print("| variant | all-to-all bytes | bytes / bf16 | step ms (median) | time / bf16 |")
    print("|---|---|---|---|---|")
    for name, (nbytes, ms) in result.items():
        print(f"| {name} | {int(nbytes)} | {nbytes / bf16_bytes:.4f} | {ms:.1f} | {ms / bf16_ms:.2f} |")


if __name__ == "__main__":
    main()
