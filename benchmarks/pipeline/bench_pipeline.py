"""cx-pipeline schedules vs torch.distributed.pipelining's, same model and micro-batches, CPU, gloo.

Run: `OMP_NUM_THREADS=1 .nox/tests/bin/python benchmarks/pipeline/bench_pipeline.py` (about 5 minutes on 2 quiet
cores; `CX_BENCH_SMOKE=1` for a seconds-long check, `CX_BENCH_WORLDS=2` for one pipeline size,
`CX_BENCH_STYLES=zbv` for some schedules, `CX_BENCH_REPEATS` for the repeats, default 3). For 2 and 4 stages and
each schedule (1F1B, interleaved 1F1B with two chunks per stage, zero-bubble V), both systems run the same stage
modules (a GPT-like model split by layer) in one set of processes, taking turns step by step (cx then torch, then
torch then cx, ...), so machine noise hits both alike; the repeats go round every case, so a load drift spreads
over all of them. Reported per case: median step time (forwards and backwards of every micro-batch, then a
barrier; no optimizer step; the slowest rank's) of cx and torch, the median of their per-round ratios with its
quartiles and the median of each repeat, the ratio of the ranks' main-thread CPU time (the per-action overhead:
Python bookkeeping, p2p posting, metadata, the split backward's graph walk), and the bubble fraction 1 - CPU time /
step time (a blocking receive sleeps and gloo sends on its own threads, so CPU time is the rank's own work). Then
both systems' action lists are run through `cx_pipeline.simulate` with unit costs and with the per-action costs
`bench_actions.py` measures (the theoretical 1F1B bubble is (p-1)/(m+p-1)). With 4 ranks on 2 cores, two
processes share a core: the 4-stage figures include that.
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
from typing import Any, cast

import torch
import torch.distributed as dist
from bench_actions import cost_model, measure_costs
from bench_pipeline_model import MICRO, SEQ, VOCAB, StageBody, lm_loss
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import spawn
from cx_pipeline import (
    Action,
    ActionKind,
    InterleavedSchedule,
    OneForwardOneBackwardSchedule,
    PipelineModel,
    PipelineStageManager,
    ZeroBubbleVPipeScheduler,
    simulate,
)
from cx_pipeline._actions import interleaved_order, one_f_one_b_order
from cx_pipeline._simulation import unit_cost
from cx_pipeline._zbv_order import zbv_order

LAYERS = 8
MICROBATCHES: tuple[int, ...] = (4, 8)
WARMUP, STEPS = 2, 10
REPEATS = int(os.environ.get("CX_BENCH_REPEATS", "3"))
STYLES = tuple(os.environ.get("CX_BENCH_STYLES", "1f1b,interleaved,zbv").split(","))
if os.environ.get("CX_BENCH_SMOKE"):
    LAYERS, MICROBATCHES, WARMUP, STEPS, REPEATS = 8, (4,), 1, 2, 2  # and bench_pipeline_model's smoke sizes


class CxStage(nn.Module):
    """The same body under cx's calling convention: the micro-batch dict plus what the previous stage sent."""

    def __init__(self, body: StageBody) -> None:
        super().__init__()
        self.body = body

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor, hidden_states: torch.Tensor | None = None) -> Any:
        out = self.body(tokens if self.body.embed is not None else hidden_states)
        return out if self.body.head is not None else {"hidden_states": out}


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


def _torch_orders(schedule: Any, world_size: int) -> list[list[Action]] | None:
    """torch's per-rank compute actions: its multi-stage schedules run their `pipeline_order` (Schedule1F1B runs its
    own loop, the textbook order; its `pipeline_order` is only a drawing, wrong for rank 1 in torch 2.13)."""
    if not isinstance(schedule, PipelineScheduleMulti):
        return None
    order = schedule.pipeline_order
    kinds = {"F": ActionKind.FORWARD, "B": ActionKind.BACKWARD, "I": ActionKind.BACKWARD_INPUT}
    kinds["W"] = ActionKind.BACKWARD_WEIGHT
    return [
        [
            Action(kinds[a.computation_type.value], a.stage_index, a.microbatch_index)
            for a in order[rank]
            if a is not None and a.computation_type.value in kinds and a.microbatch_index is not None
        ]
        for rank in range(world_size)
    ]


class Case:
    """One (schedule, stage count, micro-batch count): the same stage bodies under cx and under torch."""

    def __init__(self, rank: int, world_size: int, style: str, m: int) -> None:
        mesh = ProcessGroupMesh(world_size, axis_names=("pp",))
        self.style, self.p, self.m = style, world_size, m
        bodies, virtuals = _bodies(style, world_size, rank)
        torch_bodies = [StageBody(len(b.blocks), b.embed is not None, b.head is not None) for b in bodies]
        for mine, theirs in zip(bodies, torch_bodies, strict=True):
            theirs.load_state_dict(mine.state_dict())
        self.bodies = bodies + torch_bodies
        generator = torch.Generator().manual_seed(7)
        x = torch.randint(0, VOCAB, (MICRO * m, SEQ), generator=generator)
        y = torch.randint(0, VOCAB, (MICRO * m, SEQ), generator=generator)
        batch = {"tokens": x, "targets": y}
        self.num_virtual = num_virtual = world_size * len(bodies)

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
            return lm_loss(out, micro["targets"])

        stages = [
            PipelineStage(body, v, num_virtual, torch.device("cpu"), group=dist.group.WORLD)
            for body, v in zip(torch_bodies, virtuals, strict=True)
        ]
        if style == "1f1b":
            torch_schedule: Any = Schedule1F1B(stages[0], m, loss_fn=lm_loss)
        elif style == "interleaved":
            torch_schedule = ScheduleInterleaved1F1B(cast(Any, stages), m, loss_fn=lm_loss)
        else:
            torch_schedule = ScheduleZBVZeroBubble(cast(Any, stages), m, loss_fn=lm_loss)
        first_here = 0 in virtuals
        last_here = num_virtual - 1 in virtuals
        self.torch_orders = _torch_orders(torch_schedule, world_size)

        def run_cx() -> float | None:
            out = cx_schedule.forward_backward_step(cx_model, iter([batch]), cx_criterion, return_loss=True)
            loss = out["loss"]
            return None if loss is None else float(loss)

        def run_torch() -> float | None:
            losses: list[torch.Tensor] = []
            args = (x,) if first_here else ()
            torch_schedule.step(*args, target=y if last_here else None, losses=losses if last_here else None)
            return float(torch.stack(losses).detach().mean()) if last_here else None

        self.runs: dict[str, Callable[[], float | None]] = {"cx": run_cx, "torch": run_torch}
        self.times: dict[str, list[float]] = {"cx": [], "torch": []}
        self.busy: dict[str, list[float]] = {"cx": [], "torch": []}
        self.losses: dict[str, float | None] = {}
        self.rounds = 0

    def round(self, measure: bool) -> None:
        """One step of each system; the one going first alternates from round to round (cx, torch, torch, cx...)."""
        names = ("cx", "torch") if self.rounds % 2 == 0 else ("torch", "cx")
        self.rounds += 1
        for name in names:
            for body in self.bodies:
                body.zero_grad(set_to_none=True)
            dist.barrier()
            start, cpu = time.perf_counter(), time.thread_time()
            self.losses[name] = self.runs[name]()
            cpu = time.thread_time() - cpu  # this rank's own work: blocking receives sleep, gloo sends on its threads
            dist.barrier()
            if measure:
                self.times[name].append(time.perf_counter() - start)
                self.busy[name].append(cpu)

    def summary(self, rank: int, world_size: int) -> dict[str, Any] | None:
        """Collective: per-round step time = the slowest rank's; CPU time and bubble averaged over ranks."""
        wall = torch.tensor([self.times["cx"], self.times["torch"]], dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        cpu = torch.tensor([self.busy["cx"], self.busy["torch"]], dtype=torch.float64)
        dist.all_reduce(cpu)
        cpu /= world_size
        if rank != 0:
            return None
        p, m = self.p, self.m
        orders = {
            "1f1b": lambda: one_f_one_b_order(p, m),
            "interleaved": lambda: interleaved_order(p, 2, m),
            "zbv": lambda: zbv_order(p, m),
        }[self.style]()
        torch_orders = self.torch_orders or orders  # torch's Schedule1F1B: the same textbook order
        ratios = (wall[0] / wall[1]).tolist()
        per_repeat = [statistics.median(ratios[i : i + STEPS]) for i in range(0, len(ratios), STEPS)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        bubble = (1 - cpu / wall).median(dim=1).values.tolist()
        return {
            "style": self.style,
            "stages": p,
            "microbatches": m,
            "cx_ms": float(wall[0].median()) * 1e3,
            "torch_ms": float(wall[1].median()) * 1e3,
            "cx_cpu_ms": float(cpu[0].median()) * 1e3,
            "torch_cpu_ms": float(cpu[1].median()) * 1e3,
            "ratio": statistics.median(ratios),
            "ratio_q1": quartiles[0],
            "ratio_q3": quartiles[2],
            "repeat_ratios": per_repeat,
            "rounds": len(ratios),
            "cx_bubble": bubble[0],
            "torch_bubble": bubble[1],
            "theory_1f1b": (p - 1) / (m + p - 1),
            "simulated": simulate(orders, self.num_virtual).bubble_fraction,
            "orders": {
                name: [[[a.kind.value, a.virtual_stage, a.microbatch] for a in o] for o in value]
                for name, value in (("cx", orders), ("torch", torch_orders))
            },
            "loss_cx": self.losses["cx"],
            "loss_torch": self.losses["torch"],
        }


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    warm = Case(rank, world_size, "1f1b", MICROBATCHES[0])  # process warm-up (allocator, first collectives): discarded
    for _ in range(WARMUP + 1):
        warm.round(measure=False)
    cases = [
        Case(rank, world_size, style, m)
        for m in MICROBATCHES
        for style in STYLES
        if not (style == "interleaved" and m % world_size)
    ]
    for case in cases:
        for _ in range(WARMUP):
            case.round(measure=False)
    # Repeats go round all cases, so a drift in the machine's load spreads over every case instead of one.
    for _ in range(REPEATS):
        for case in cases:
            for _ in range(STEPS):
                case.round(measure=True)
    summaries = [case.summary(rank, world_size) for case in cases]
    results = [result for result in summaries if result is not None]
    if rank == 0:
        for result in results:
            print(json.dumps({k: v for k, v in result.items() if k != "orders"}), flush=True)
        Path(out).write_text(json.dumps(results))


def main() -> None:
    print(f"load average at the start: {os.getloadavg()}")
    costs = measure_costs(5 if os.environ.get("CX_BENCH_SMOKE") else 30)
    rows = []
    worlds = tuple(int(w) for w in os.environ.get("CX_BENCH_WORLDS", "2,4").split(","))
    for world_size in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "results.json"
            spawn(_worker, world_size, str(path), timeout=3600)
            rows += json.loads(path.read_text())
    print(f"{REPEATS} repeats x {STEPS} rounds per case; cx / torch: median of the per-round ratios [quartiles], and")
    print("the median of each repeat (min-max). Step time = the slowest rank's, median over rounds.")
    print()
    print("| stages | micro-batches | schedule | cx ms | torch ms | cx / torch [q1-q3] | per repeat | "
          "cx cpu / torch cpu | cx bubble | torch bubble | 1F1B theory | simulated |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        reps = r["repeat_ratios"]
        print(
            f"| {r['stages']} | {r['microbatches']} | {r['style']} | {r['cx_ms']:.0f} | {r['torch_ms']:.0f} | "
            f"**{r['ratio']:.2f}** [{r['ratio_q1']:.2f}-{r['ratio_q3']:.2f}] | {min(reps):.2f}-{max(reps):.2f} | "
            f"{r['cx_cpu_ms'] / r['torch_cpu_ms']:.2f} | {r['cx_bubble']:.2f} | {r['torch_bubble']:.2f} | "
            f"{r['theory_1f1b']:.2f} | {r['simulated']:.2f} |"
        )
    print()
    print("Simulated bubble of each order (cx's and torch's action lists run by `cx_pipeline.simulate`): unit-time")
    print("actions, and the per-action costs measured by bench_actions.py (each rank runs its list as listed).")
    print("Costs (ms):")
    print(json.dumps({k: {n: round(v, 1) for n, v in c.items()} for k, c in costs.items()}))
    print()
    print("| stages | micro-batches | schedule | 1F1B theory | cx unit | torch unit | cx measured | torch measured | "
          "same order |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        nv = r["stages"] * (1 if r["style"] == "1f1b" else 2)
        cells = []
        for cost in (unit_cost, cost_model(costs, nv)):
            for name in ("cx", "torch"):
                orders = [[Action(ActionKind(k), v, mb) for k, v, mb in o] for o in r["orders"][name]]
                cells.append(f"{simulate(orders, nv, cost).bubble_fraction:.3f}")
        same = "yes" if r["orders"]["cx"] == r["orders"]["torch"] else "no"
        row = f"| {r['stages']} | {r['microbatches']} | {r['style']} | {r['theory_1f1b']:.3f} | {' | '.join(cells)} |"
        print(f"{row} {same} |")
    print(f"load average at the end: {os.getloadavg()}")
    for r in rows:
        if r["loss_cx"] is not None and r["loss_torch"] is not None:
            assert abs(r["loss_cx"] - r["loss_torch"]) < 1e-4 * max(1.0, abs(r["loss_torch"])), r
    sys.stdout.flush()


if __name__ == "__main__":
    main()
