"""cx-plan's step-time prediction against measured step times on this CPU: the ranking of a few 2-process layouts.

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo .nox/tests/bin/python benchmarks/plan/bench_step_time.py`
(`CX_BENCH_SMOKE=1` for a seconds-long check). cx's reference GPT (fp32, torch AdamW) is trained by each candidate
through the Booster on 2 processes with one thread each, the same global batch for all; the systems take turns step by
step (machine noise hits all alike) and each figure is the median step (forward, backward, optimizer, barrier).
The prediction is `predict_step_time` for the `cpu` device and the `loopback` link of `cx_plan._devices`
(measured rows, default achievable fraction, the trace's op counts for the host terms). Printed: predicted and
measured ms, both rankings, the top-3 agreement.
`--calibrate` instead measures the host costs the `cpu` / `loopback` rows hold (per aten op, per AdamW tensor, per
gloo collective on 2 and 4 processes, each plugin's own work per tensor): see `calibrate_cpu.py`.
No assertion: timing on a shared machine belongs in a benchmark, not a test.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from cx_mesh.testing import spawn
from cx_plan import Candidate, lookup_device, make_plugin
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace._model_spec import shape_from_config
from cx_plan.trace._op_counts import op_counter
from cx_plugins.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared step timing
from bench_timing import time_in_turns

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, GLOBAL_BATCH = 4, 256, 4, 4096, 128, 8
WARMUP, STEPS = 2, 8
if os.environ.get("CX_BENCH_SMOKE"):
    LAYERS, HIDDEN, VOCAB, SEQ, STEPS = 2, 32, 128, 16, 2
CONFIG = GPTConfig(vocab_size=VOCAB, max_positions=SEQ, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS)

CANDIDATES = {
    "torch_ddp dp2": Candidate("torch_ddp", dp=2, micro_batch_size=4, precision="fp32"),
    "torch_fsdp dp2": Candidate("torch_fsdp", dp=2, micro_batch_size=4, precision="fp32"),
    "low_level_zero dp2 zero2": Candidate("low_level_zero", dp=2, micro_batch_size=4, precision="fp32"),
    "gemini dp2": Candidate("gemini", dp=2, micro_batch_size=4, precision="fp32"),
    "hybrid dp2 zero1": Candidate("hybrid", dp=2, zero_stage=1, micro_batch_size=4, precision="fp32"),
    "hybrid tp2": Candidate("hybrid", tp=2, micro_batch_size=8, precision="fp32"),
    "hybrid pp2 1f1b mb2x4": Candidate("hybrid", pp=2, micro_batch_size=2, num_microbatches=4, precision="fp32"),
}
Step = Callable[[torch.Tensor], None]


def _system(candidate: Candidate) -> Step:
    from cx_plugins import Booster

    net = GPT(CONFIG)
    plugin, mixed_precision = make_plugin(candidate, net)  # the plugin cx-train and cx-plan --measure make
    booster = Booster(plugin=plugin, mixed_precision=mixed_precision)
    model, optimizer, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    assert optimizer is not None
    rows = candidate.micro_batch_size * candidate.num_microbatches  # sequences per data-parallel rank
    data_rank = dist.get_rank() if candidate.dp > 1 else 0

    def step(ids: torch.Tensor) -> None:
        mine = ids[data_rank * rows : (data_rank + 1) * rows]
        if candidate.pp > 1:
            batch = {"input_ids": mine, "labels": mine}
            booster.execute_pipeline(iter([batch]), model, lambda out, _: out, optimizer)
        else:
            booster.backward(model(mine, labels=mine), optimizer)
        optimizer.step()
        optimizer.zero_grad()

    return step


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    systems = {name: _system(candidate) for name, candidate in CANDIDATES.items()}
    times = time_in_turns(systems, _batch, WARMUP, STEPS)
    if rank == 0:
        Path(out).write_text(json.dumps({name: statistics.median(v) for name, v in times.items()}))


def _ranks(values: dict[str, float]) -> dict[str, int]:
    return {name: i + 1 for i, name in enumerate(sorted(values, key=values.__getitem__))}


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    if "--calibrate" in sys.argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import calibrate_cpu

        print(json.dumps({"costs": calibrate_cpu.calibrate(), "plugins": calibrate_cpu.calibrate_plugins()}, indent=1))
        return
    shape = shape_from_config("gpt", CONFIG)
    device = lookup_device("cpu")
    ops = op_counter(shape, SEQ)  # the host terms' op and tensor counts, from the trace
    predicted = {
        name: predict_step_time(c, shape, SEQ, device, ops=ops(c)).step_s * 1e3 for name, c in CANDIDATES.items()
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "result.json")
        spawn(_worker, 2, path, timeout=1800)
        measured: dict[str, float] = json.loads(Path(path).read_text())
    p_rank, m_rank = _ranks(predicted), _ranks(measured)
    print(f"GPT {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}, seq {SEQ}, global batch {GLOBAL_BATCH}, fp32, 2 ranks")
    print(
        f"{'configuration':<26} {'predicted ms':>13} {'measured ms':>12} {'pred/meas':>9} {'rank p':>7} {'rank m':>7}"
    )
    for name in CANDIDATES:
        ratio = predicted[name] / measured[name]
        print(
            f"{name:<26} {predicted[name]:>13.1f} {measured[name]:>12.1f} {ratio:>9.2f} {p_rank[name]:>7} "
            f"{m_rank[name]:>7}"
        )
    top_p = sorted(predicted, key=predicted.__getitem__)[:3]
    top_m = sorted(measured, key=measured.__getitem__)[:3]
    print(f"top 3 predicted: {top_p}")
    print(f"top 3 measured:  {top_m}")
    print(f"top-3 order agrees: {top_p == top_m}; top-3 sets agree: {set(top_p) == set(top_m)}")


def _batch(index: int) -> torch.Tensor:
    """The seeded batch of step `index`, the same on every rank and for every system."""
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(index))


if __name__ == "__main__":
    main()
