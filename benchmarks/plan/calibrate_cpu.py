"""What this CPU machine charges for the work a tiny model's training step is made of, for the `cpu` / `loopback`
rows of `cx_plan._devices` (run by `bench_step_time.py --calibrate`, or directly).

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .nox/tests/bin/python benchmarks/plan/calibrate_cpu.py`
(prints one JSON object; a minute or two). On 1, 2 and 4 processes at once (one thread each), every rank measures:
- `op_s`: seconds per aten op of the forward and backward of a calibration GPT (hidden 32, 4 layers, seq 16, batch 1:
  matmuls of a few thousand FLOPs, so dispatch is the cost), the median of 20 steps over the ops a dispatch mode
  counts; on more processes than cores the ratio to 1 process is what oversubscription costs;
- `optimizer_tensor_s`: one torch AdamW step (its CPU per-parameter loop) over 256 tensors of 16 elements, per tensor;
- with more than one process, gloo on loopback: the median time of a 4-byte all_reduce, all_gather_into_tensor,
  reduce_scatter_tensor and all_to_all_single (the per-call latency, Python included), and the bandwidth of a 16 MiB
  all_reduce (bus bandwidth, 2(n-1)/n x bytes / time).
The ranks run each measurement together, between barriers, as the ranks of a training job do.
`calibrate_plugins`: each plugin's step on a hidden-32, 4-layer GPT (52 parameter tensors, micro-batch 2) on 1 and 2
processes, the plugins taking turns step by step (`bench_timing.time_in_turns`); a plugin's own work per tensor is its
median step minus hybrid ZeRO 0's (the model and AdamW alone on one rank), over the tensors. On a loaded machine every
step stretches alike: scale by the ratio of hybrid ZeRO 0's step to a quiet run's (as the `cpu` row's comment says).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cx_mesh.testing import spawn
from cx_plugins.models import GPT, GPTConfig

CONFIG = GPTConfig(vocab_size=64, max_positions=17, hidden_size=32, num_layers=4, num_heads=4)
SEQ, STEPS, TENSORS = 16, 20, 256


class OpCount(TorchDispatchMode):
    """The number of aten ops dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.namespace == "aten"
        return func(*args, **(kwargs or {}))


def _median_s(run: Callable[[], object], steps: int, world: int) -> float:
    times = []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _model_step(model: GPT, ids: torch.Tensor) -> None:
    model(ids, labels=ids).backward()
    model.zero_grad(set_to_none=True)


def _collectives(world: int) -> dict[str, float]:
    small = torch.ones(world)
    gathered = torch.empty(world * world)
    found = {
        "all_reduce_s": _median_s(lambda: dist.all_reduce(small), 200, world),
        "all_gather_s": _median_s(lambda: dist.all_gather_into_tensor(gathered, small), 200, world),
        "reduce_scatter_s": _median_s(lambda: dist.reduce_scatter_tensor(small[:1], small), 200, world),
        "all_to_all_s": _median_s(lambda: dist.all_to_all_single(torch.empty(world), small), 200, world),
    }
    big = torch.ones(4 * 2**20)  # 16 MiB of fp32
    seconds = _median_s(lambda: dist.all_reduce(big), 5, world)
    found["bus_bandwidth"] = 2 * (world - 1) / world * big.nbytes / seconds
    return found


def _rank(rank: int, world: int, out: str) -> None:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    ids = torch.randint(0, CONFIG.vocab_size, (1, SEQ))
    with OpCount() as forward:
        loss = model(ids, labels=ids)
    with OpCount() as backward:
        loss.backward()
    model.zero_grad(set_to_none=True)
    _median_s(lambda: _model_step(model, ids), 3, world)  # warm-up
    step_s = _median_s(lambda: _model_step(model, ids), STEPS, world)
    params = [torch.nn.Parameter(torch.randn(16)) for _ in range(TENSORS)]
    for p in params:
        p.grad = torch.randn(16)
    adam = torch.optim.AdamW(params, lr=1e-3)
    adam.step()
    with OpCount() as adam_ops:
        adam.step()
    adam_s = _median_s(adam.step, STEPS, world)
    result: dict[str, Any] = {
        "world": world,
        "forward_ops": forward.count,
        "backward_ops": backward.count,
        "op_s": step_s / (forward.count + backward.count),
        "optimizer_tensor_s": adam_s / TENSORS,
        "optimizer_ops_per_tensor": adam_ops.count / TENSORS,
    }
    if world > 1:
        result.update(_collectives(world))
    Path(out, f"{rank}.json").write_text(json.dumps(result))


def calibrate(worlds: tuple[int, ...] = (1, 2, 4)) -> dict[int, dict[str, float]]:
    """Per world size: every figure's median over the ranks."""
    found: dict[int, dict[str, float]] = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as out:
            spawn(_rank, world, out, timeout=600)
            ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]
        found[world] = {key: statistics.median(r[key] for r in ranks) for key in ranks[0]}
        print(json.dumps(found[world]), file=sys.stderr, flush=True)
    return found


PLUGINS: dict[str, dict[str, Any]] = {
    "hybrid zero0": {"plugin": "hybrid", "zero_stage": 0},
    "torch_ddp": {"plugin": "torch_ddp"},
    "torch_fsdp": {"plugin": "torch_fsdp"},
    "torch_fsdp per-block": {"plugin": "torch_fsdp", "fsdp_wrap": "block"},
    "zero1": {"plugin": "low_level_zero", "zero_stage": 1},
    "zero2": {"plugin": "low_level_zero", "zero_stage": 2},
    "gemini": {"plugin": "gemini"},
}


def _plugin_rank(rank: int, world: int, out: str) -> None:
    """Each plugin's step on the calibration GPT (micro-batch 2), in turns, on this many processes."""
    from bench_timing import time_in_turns
    from cx_plan._candidate import Candidate
    from cx_plan.measure._measure import _prepare

    torch.set_num_threads(1)
    systems = {}
    for name, fields in PLUGINS.items():
        step = _prepare(Candidate(dp=world, micro_batch_size=2, precision="fp32", **fields), "gpt", 32, 4, SEQ)
        systems[name] = lambda _ids, step=step: step()
    times = time_in_turns(systems, lambda i: torch.zeros(1), 3, STEPS)
    tensors = sum(1 for _ in GPT(GPTConfig(vocab_size=64, max_positions=17, hidden_size=32, num_layers=4)).parameters())
    if rank == 0:
        medians = {name: statistics.median(t) / 1e3 for name, t in times.items()}
        Path(out, "plugins.json").write_text(json.dumps({"tensors": tensors, "step_s": medians}))


def calibrate_plugins(worlds: tuple[int, ...] = (1, 2)) -> dict[int, dict[str, Any]]:
    """Per world size: each plugin's median step and the calibration model's parameter tensors."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared step timing
    found = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as out:
            spawn(_plugin_rank, world, out, timeout=600)
            found[world] = json.loads(Path(out, "plugins.json").read_text())
        print(json.dumps(found[world]), file=sys.stderr, flush=True)
    return found


if __name__ == "__main__":
    print(json.dumps({"costs": calibrate(), "plugins": calibrate_plugins()}, indent=1))
