"""cx-pipeline schedules vs torch.distributed.pipelining's, same model and micro-batches, CPU, gloo.

Run: `OMP_NUM_THREADS=1 .nox/tests/bin/python benchmarks/pipeline/bench_pipeline.py` (a few minutes on 2 cores;
`CX_BENCH_SMOKE=1` for a seconds-long check, `CX_BENCH_WORLDS=2` for one pipeline size). For 2 and 4 stages and
each schedule (1F1B, interleaved 1F1B with two chunks per stage, zero-bubble V), both systems run the same stage
modules (a GPT-like model split by layer) in one set of processes, taking turns step by step, so machine noise hits
both alike. Reported per case: median step time (forwards and backwards of every micro-batch, then a barrier; no
optimizer step) of cx and torch, the median of their per-round ratios, and the bubble fraction: 1 - (the rank's
main-thread CPU time in the step) / (step wall time), median over steps, averaged over ranks (a blocking receive
sleeps; gloo sends on its own threads; so CPU time is the rank's own work, Python bookkeeping included), plus an
estimate from the marginal cost of a micro-batch. The theoretical 1F1B bubble is (p-1)/(m+p-1); `simulate` gives
each schedule's bubble with unit-time actions. With 4 ranks on 2 cores, two processes share a core: the 4-stage
figures include that.
"""

from __future__ import annotations

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
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import spawn
from cx_pipeline import (
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineModel,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
    simulate,
)
from cx_pipeline._actions import interleaved_order, one_f_one_b_order
from cx_pipeline._zbv_order import zbv_order

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, MICRO = 8, 128, 4, 1024, 64, 4
MICROBATCHES = (4, 8)
WARMUP, STEPS = 2, 10
if os.environ.get("CX_BENCH_SMOKE"):
    LAYERS, HIDDEN, VOCAB, SEQ, MICRO, MICROBATCHES, WARMUP, STEPS = 8, 32, 64, 8, 2, (4,), 1, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(HIDDEN)
        self.c_attn = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.c_proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln_2 = nn.LayerNorm(HIDDEN)
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        out: torch.Tensor = x + self.proj(F.gelu(self.fc(self.ln_2(x))))
        return out


class StageBody(nn.Module):
    """Layers of one virtual stage, tensor in, tensor out (what torch's PipelineStage runs)."""

    def __init__(self, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN) if first else None
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        return self.head(h) if self.head is not None else h


class CxStage(nn.Module):
    """The same body under cx's calling convention: the micro-batch dict plus what the previous stage sent."""

    def __init__(self, body: StageBody) -> None:
        super().__init__()
        self.body = body

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, hidden_states: torch.Tensor | None = None) -> Any:
        out = self.body(tokens if self.body.embed is not None else hidden_states)
        return out if self.body.head is not None else {"hidden_states": out}


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _bodies(style: str, p: int, stage: int) -> tuple[list[StageBody], list[int]]:
    chunks = 1 if style == "1f1b" else 2
    virtual_count = p * chunks
    per = LAYERS // virtual_count
    if style == "1f1b":
        virtuals = [stage]
    elif style == "interleaved":
        virtuals = [stage, p + stage]
    else:
        virtuals = [stage, 2 * p - 1 - stage]
    torch.manual_seed(1000 + stage)
    return [StageBody(per, v == 0, v == virtual_count - 1) for v in virtuals], virtuals


def _case(rank: int, world_size: int, style: str, m: int) -> dict[str, Any] | None:
    mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
    bodies, virtuals = _bodies(style, world_size, rank)
    torch_bodies = [StageBody(len(b.blocks), b.embed is not None, b.head is not None) for b in bodies]
    for mine, theirs in zip(bodies, torch_bodies, strict=True):
        theirs.load_state_dict(mine.state_dict())
    generator = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (MICRO * m, SEQ), generator=generator)
    y = torch.randint(0, VOCAB, (MICRO * m, SEQ), generator=generator)
    batch = {"tokens": x, "targets": y}
    p = world_size
    num_virtual = p * len(bodies)

    # cx
    if style == "1f1b":
        manager = PipelineStageManager(mesh, "pp")
        cx_schedule: Any = OneForwardOneBackwardSchedule(manager, num_microbatches=m)
    elif style == "interleaved":
        manager = PipelineStageManager(mesh, "pp", enable_interleave=True, num_model_chunks=2)
        cx_schedule = InterleavedSchedule(manager, num_model_chunks=2, num_microbatch=m)
    else:
        manager = PipelineStageManager(mesh, "pp", use_zbv=True, num_model_chunks=2)
        cx_schedule = ZeroBubbleVPipeScheduler(manager, num_model_chunks=2, num_microbatch=m)
    cx_model = PipelineModel([CxStage(b) for b in bodies])

    def cx_criterion(out: torch.Tensor, micro: dict[str, torch.Tensor]) -> torch.Tensor:
        return _loss(out, micro["targets"])

    # torch
    stages = [
        PipelineStage(body, v, num_virtual, torch.device("cpu"), group=dist.group.WORLD)
        for body, v in zip(torch_bodies, virtuals, strict=True)
    ]
    if style == "1f1b":
        torch_schedule: Any = Schedule1F1B(stages[0], m, loss_fn=_loss)
    elif style == "interleaved":
        torch_schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=_loss)
    else:
        torch_schedule = ScheduleZBVZeroBubble(stages, m, loss_fn=_loss)
    first_here = 0 in virtuals
    last_here = num_virtual - 1 in virtuals

    def run_cx() -> float | None:
        out = cx_schedule.forward_backward_step(cx_model, iter([batch]), cx_criterion, return_loss=True)
        loss = out["loss"]
        return None if loss is None else float(loss)

    def run_torch() -> float | None:
        losses: list[torch.Tensor] = []
        args = (x,) if first_here else ()
        torch_schedule.step(*args, target=y if last_here else None, losses=losses if last_here else None)
        return float(torch.stack(losses).detach().mean()) if last_here else None

    runs: dict[str, Callable[[], float | None]] = {"cx": run_cx, "torch": run_torch}
    times: dict[str, list[float]] = {"cx": [], "torch": []}
    busy: dict[str, list[float]] = {"cx": [], "torch": []}
    losses: dict[str, float | None] = {}
    for step in range(WARMUP + STEPS):
        for name, run in runs.items():
            for body in bodies + torch_bodies:
                body.zero_grad(set_to_none=True)
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            losses[name] = run()
            cpu = time.thread_time() - cpu  # this rank's own work: blocking receives sleep, gloo sends on its threads
            dist.barrier()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - start)
                busy[name].append(cpu)
    idle = [1 - statistics.median(b / t for b, t in zip(busy[n], times[n], strict=True)) for n in ("cx", "torch")]
    stats = torch.tensor(
        [statistics.median(times["cx"]), statistics.median(times["torch"]), *idle], dtype=torch.float64
    )
    gathered = [torch.zeros_like(stats) for _ in range(world_size)]
    dist.all_gather(gathered, stats)
    ratios = [c / t for c, t in zip(times["cx"], times["torch"], strict=True)]
    ratio = torch.tensor([statistics.median(ratios)], dtype=torch.float64)
    dist.all_reduce(ratio)
    if rank != 0:
        return None
    cx_ms = statistics.mean(float(g[0]) for g in gathered) * 1e3
    torch_ms = statistics.mean(float(g[1]) for g in gathered) * 1e3
    orders = {
        "1f1b": lambda: one_f_one_b_order(p, m),
        "interleaved": lambda: interleaved_order(p, 2, m),
        "zbv": lambda: zbv_order(p, m),
    }[style]()
    return {
        "style": style,
        "stages": p,
        "microbatches": m,
        "cx_ms": cx_ms,
        "torch_ms": torch_ms,
        "ratio": float(ratio) / world_size,
        "cx_bubble": statistics.mean(float(g[2]) for g in gathered),
        "torch_bubble": statistics.mean(float(g[3]) for g in gathered),
        "theory_1f1b": (p - 1) / (m + p - 1),
        "simulated": simulate(orders, num_virtual).bubble_fraction,
        "loss_cx": losses["cx"],
        "loss_torch": losses["torch"],
    }


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    results = []
    _case(rank, world_size, "1f1b", MICROBATCHES[0])  # process warm-up (allocator, first collectives): discarded
    for m in MICROBATCHES:
        for style in ("1f1b", "interleaved", "zbv"):
            if style == "interleaved" and m % world_size:
                continue
            result = _case(rank, world_size, style, m)
            if result is not None:
                results.append(result)
                print(json.dumps(result), flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    print(f"load average at the start: {os.getloadavg()}")
    rows = []
    worlds = tuple(int(w) for w in os.environ.get("CX_BENCH_WORLDS", "2,4").split(","))
    for world_size in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "results.json"
            spawn(_worker, world_size, str(path), timeout=1800)
            rows += json.loads(path.read_text())
    print("| stages | micro-batches | schedule | cx ms | torch ms | cx / torch | cx bubble | torch bubble | "
          "1F1B theory | simulated |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stages']} | {r['microbatches']} | {r['style']} | {r['cx_ms']:.0f} | {r['torch_ms']:.0f} | "
            f"**{r['ratio']:.2f}** | {r['cx_bubble']:.2f} | {r['torch_bubble']:.2f} | {r['theory_1f1b']:.2f} | "
            f"{r['simulated']:.2f} |"
        )
    print()
    print(
        "Bubble from the marginal cost of a micro-batch: with steps s4, s8 at 4 and 8 micro-batches, t = (s8 - s4) / 4"
    )
    print("per micro-batch and bubble(4) = 1 - 4t / s4 (1F1B theory: (p-1)/(p+3)).")
    print()
    print("| stages | schedule | cx bubble(4) | torch bubble(4) | 1F1B theory (m=4) | simulated (m=4) |")
    print("|---|---|---|---|---|---|")
    by_key = {(r["stages"], r["style"], r["microbatches"]): r for r in rows}
    for (p, style, m), r4 in by_key.items():
        r8 = by_key.get((p, style, 2 * m))
        if m != 4 or r8 is None:
            continue
        estimates = [1 - (r8[k] - r4[k]) / r4[k] for k in ("cx_ms", "torch_ms")]
        print(
            f"| {p} | {style} | {estimates[0]:.2f} | {estimates[1]:.2f} | {r4['theory_1f1b']:.2f} | "
            f"{r4['simulated']:.2f} |"
        )
    print(f"load average at the end: {os.getloadavg()}")
    for r in rows:
        if r["loss_cx"] is not None and r["loss_torch"] is not None:
            assert abs(r["loss_cx"] - r["loss_torch"]) < 1e-4 * max(1.0, abs(r["loss_torch"])), r
    sys.stdout.flush()


if __name__ == "__main__":
    main()
