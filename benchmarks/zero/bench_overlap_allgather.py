"""What `overlap_allgather=True` gains now that every pending all-gather is finished at the first module forward.

Run: `OMP_NUM_THREADS=1 .nox/tests/bin/python benchmarks/zero/bench_overlap_allgather.py` (about 2 minutes).
The GPT-like model of bench_low_level_zero.py (5.29M parameters), ZeRO-2 + HybridAdam, world 2, fp32, CPU/gloo,
with and without overlap_allgather, side by side in one pair of processes. Each measurement is a block of
consecutive training steps with no barrier inside (a barrier on the same group would wait for the gathers and hide
any overlap); before each forward the loop spends `host_ms` waiting, as a training process does on its DataLoader
queue (workers in other processes). The all-gathers can only hide behind that wait and zero_grad: the forward's
first module now waits for all of them. Reported: median ms per step and the median of paired ratios.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from cx_zero import HybridAdam, LowLevelZeroOptimizer

ROUNDS, BLOCK, WARMUP = 6, 3, 1
HOST_MS = (0, 30)


def run_ranks(rank: int, world_size: int, out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_low_level_zero import BATCH, GPT, SEQ, VOCAB, _loss

    torch.manual_seed(0)
    base = GPT()
    systems: dict[str, tuple[torch.nn.Module, LowLevelZeroOptimizer]] = {}
    for overlap in (False, True):
        model: torch.nn.Module = GPT()
        model.load_state_dict(base.state_dict())
        inner = HybridAdam(model.parameters(), lr=1e-4, weight_decay=0.01)
        zero = LowLevelZeroOptimizer(inner, partition_grad=True, overlap_communication=True, overlap_allgather=overlap)
        systems[f"overlap_allgather={overlap}"] = (model, zero)
    g = torch.Generator().manual_seed(rank)
    result: dict[str, dict[str, float]] = {}
    for host_ms in HOST_MS:
        times: dict[str, list[float]] = {name: [] for name in systems}
        names = list(systems)
        for round_ in range(WARMUP + ROUNDS):
            for name in names[round_ % 2 :] + names[: round_ % 2]:
                model, zero = systems[name]
                dist.barrier()
                start = time.perf_counter()
                for _ in range(BLOCK):
                    zero.zero_grad()
                    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
                    time.sleep(host_ms / 1000)  # waiting on the DataLoader's queue
                    zero.backward(_loss(model, tokens))
                    zero.step()
                zero.synchronize_working_params()
                if round_ >= WARMUP:
                    times[name].append((time.perf_counter() - start) / BLOCK)
        base_name, overlap_name = names
        result[f"host {host_ms} ms"] = {
            "off_ms": 1000 * statistics.median(times[base_name]),
            "on_ms": 1000 * statistics.median(times[overlap_name]),
            "paired": statistics.median(a / b for a, b in zip(times[overlap_name], times[base_name], strict=True)),
        }
    if rank == 0:
        Path(out_path).write_text(json.dumps(result))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_overlap_allgather as this  # the spawned ranks import the function by module name

    from cx_mesh.testing import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        spawn(this.run_ranks, 2, out, timeout=900)
        result = json.loads(Path(out).read_text())
    print("ZeRO-2 + HybridAdam, GPT-like 5.29M parameters, world 2, fp32, CPU/gloo, 1 thread per rank")
    print("| host wait before each forward | overlap off ms/step | overlap on ms/step | on/off (median of paired) |")
    print("|---|---|---|---|")
    for setting, row in result.items():
        print(f"| {setting} | {row['off_ms']:.0f} | {row['on_ms']:.0f} | {row['paired']:.3f}x |")


if __name__ == "__main__":
    main()
