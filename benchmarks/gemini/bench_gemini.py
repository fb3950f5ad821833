"""Gemini (GeminiDDP + GeminiOptimizer) vs PyTorch FSDP2 (`fully_shard` per block + root), world 2, CPU, gloo.

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/gemini/bench_gemini.py` (about 4 minutes on 2 quiet cores;
`CX_BENCH_BF16_ONLY=1`: only part 1's bf16 rounds, Gemini and FSDP2, which stays short on a loaded machine).
Part 1 trains the same GPT-like model (12 layers, hidden 256, 4 heads, vocab 4096, seq 128, micro-batch 8 per rank,
tied LM head, torch AdamW) with each system in one pair of processes, taking turns step by step so that machine noise
hits all systems alike: fp32, bf16 (Gemini: bf16 chunks + fp32 master; FSDP2: MixedPrecisionPolicy bf16 params,
fp32 reduce) and optimizer offload (Gemini offload_optim_frac=1 vs FSDP2 CPUOffloadPolicy(pin_memory=False)). It
reports the median step time (forward, backward, step, barrier) and Gemini's peak model data per rank (chunk bytes
at their peak, from cx-chunk's exact accounting, plus optimizer state) against the ZeRO-3 ideal. Part 2 times one
step of HybridAdam vs torch AdamW (default and foreach) on a 100M-element fp32 CPU tensor, 1 thread. Part 3 gives
Gemini's peak model data per rank by depth (exact accounting). Part 4 runs each system alone in a fresh pair of
processes under the profiler (`profile_memory=True` from before the model is built) and reports the peak of all
live tensor bytes per rank during a step: the like-for-like memory comparison with FSDP2.
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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cx_mesh.testing import spawn
from cx_zero import HybridAdam
from cx_zero.gemini import GeminiDDP, GeminiOptimizer

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = int(os.environ.get("CX_BENCH_LAYERS", 12)), 256, 4, 4096, 128, 8
WARMUP, STEPS, ADAM_NUMEL = 2, 12, 100_000_000
CHUNK_M = float(os.environ.get("CX_BENCH_CHUNK_M", 0.25))  # Gemini min_chunk_size_m; the search then finds one block
DEPTHS: tuple[int, ...] = (2, 4, 8, 12, 24)  # part 3: peak model data by depth (exact accounting, no timing)
BF16_ONLY = bool(os.environ.get("CX_BENCH_BF16_ONLY"))  # part 1's bf16 rounds only (Gemini, max_prefetch=2, FSDP2)
if os.environ.get("CX_BENCH_SMOKE"):  # a seconds-long run that only checks the script works
    LAYERS, HIDDEN, VOCAB, SEQ, STEPS, ADAM_NUMEL, DEPTHS = 1, 32, 64, 16, 2, 1_000_000, (1, 2)


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


class GPT(nn.Module):
    def __init__(self, layers: int = LAYERS) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        self.h = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe
        for block in self.h:
            x = block(x)
        out: torch.Tensor = self.lm_head(self.ln_f(x))
        return out


def _model(layers: int = LAYERS) -> GPT:
    torch.manual_seed(0)
    return GPT(layers)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


Step = Callable[[torch.Tensor, torch.Tensor], None]


def _gemini(
    dtype: torch.dtype, offload: bool, hybrid: bool = False, prefetch: int = 0, layers: int = LAYERS
) -> tuple[Step, Callable[[], dict[str, float]]]:
    ddp = GeminiDDP(
        _model(layers),
        mixed_precision=dtype,
        min_chunk_size_m=CHUNK_M,  # the default, 32M, would keep this small model as one replicated DDP chunk
        search_range_m=1,
        hidden_dim=HIDDEN,
        offload_optim_frac=1.0 if offload else 0.0,
        max_prefetch=prefetch,
    )
    params = list(ddp.parameters())
    inner = HybridAdam(params, lr=1e-4) if hybrid else torch.optim.AdamW(params, lr=1e-4)
    optimizer = GeminiOptimizer(inner, ddp)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        optimizer.backward(_loss(ddp(x), y))
        optimizer.step()

    def memory() -> dict[str, float]:
        numel = sum(slot.numel for chunk in ddp.manager.chunks() for slot in chunk.slots)
        peak = ddp.manager.peak
        state = sum(
            v.numel() * v.element_size()
            for s in inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        usage = ddp.manager.usage
        return {
            "numel": numel,
            "peak_chunk_bytes": peak.device + peak.host,
            "rest_chunk_bytes": usage.device + usage.host,
            "optimizer_state_bytes": state,
        }

    return step, memory


def _fsdp(dtype: torch.dtype, offload: bool) -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    model = _model()
    for module in [*model.h, model]:
        if mp is not None and offload:
            fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=False))
        elif mp is not None:
            fully_shard(module, mesh=mesh, mp_policy=mp)
        elif offload:
            fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
        else:
            fully_shard(module, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        _loss(model(x), y).backward()
        optimizer.step()

    return step


def _deepspeed(dtype: torch.dtype, rank: int, world_size: int) -> Step | None:
    """DeepSpeed ZeRO-3 on the CPU (the optional column; None when DeepSpeed is not installed), as ../shared/peers.md
    describes: DS_ACCELERATOR=cpu, the process group cx already made, the same torch AdamW."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name, value in (("LOCAL_RANK", rank), ("RANK", rank), ("WORLD_SIZE", world_size)):
        os.environ.setdefault(name, str(value))
    try:
        import deepspeed  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        return None
    import logging
    import warnings

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")  # DeepSpeed's old names
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()

    return step


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen) for _ in range(4)]
    cases: dict[str, tuple[Step, Callable[[], dict[str, float]] | None]] = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if BF16_ONLY and label == "fp32":
            continue
        g_step, g_mem = _gemini(dtype, offload=False)
        cases[f"gemini {label}"] = (g_step, g_mem)
        g_step, g_mem = _gemini(dtype, offload=False, prefetch=2)
        cases[f"gemini {label} max_prefetch=2"] = (g_step, g_mem)
        cases[f"fsdp2 {label}"] = (_fsdp(dtype, offload=False), None)
        deepspeed_step = _deepspeed(dtype, rank, world_size)
        if deepspeed_step is not None:
            cases[f"deepspeed zero3 {label}"] = (deepspeed_step, None)
    if not BF16_ONLY:
        g_step, g_mem = _gemini(torch.float32, offload=True)
        cases["gemini fp32 offload_optim"] = (g_step, g_mem)
        cases["fsdp2 fp32 CPUOffloadPolicy"] = (_fsdp(torch.float32, offload=True), None)
        g_step, g_mem = _gemini(torch.float32, offload=True, hybrid=True)
        cases["gemini fp32 offload_optim + HybridAdam"] = (g_step, g_mem)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(WARMUP + STEPS):
        batch = data[i % len(data)]
        for name, (step, _) in cases.items():
            dist.barrier()
            start = time.perf_counter()
            step(batch[:, :-1], batch[:, 1:])
            dist.barrier()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    depth: dict[str, dict[str, float]] = {}
    for layers in () if BF16_ONLY else DEPTHS:  # memory only: one pair of steps per depth, exact accounting
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            g_step, g_mem = _gemini(dtype, offload=False, layers=layers)
            for batch in data[:2]:
                g_step(batch[:, :-1], batch[:, 1:])
            depth[f"{layers} {label}"] = g_mem()
    if rank == 0:
        result: dict[str, dict[str, float]] = {
            name: {"ms": 1000 * statistics.median(times[name]), **(memory() if memory else {})}
            for name, (_, memory) in cases.items()
        }
        # ratios of steps taken back to back in the same round, so machine load common to both cancels
        pairs = {
            "gemini/fsdp2 fp32": ("gemini fp32", "fsdp2 fp32"),
            "gemini/fsdp2 fp32 max_prefetch=2": ("gemini fp32 max_prefetch=2", "fsdp2 fp32"),
            "gemini/fsdp2 bf16": ("gemini bf16", "fsdp2 bf16"),
            "gemini/fsdp2 bf16 max_prefetch=2": ("gemini bf16 max_prefetch=2", "fsdp2 bf16"),
            "gemini/fsdp2 offload": ("gemini fp32 offload_optim", "fsdp2 fp32 CPUOffloadPolicy"),
            "gemini/fsdp2 offload + HybridAdam": (
                "gemini fp32 offload_optim + HybridAdam",
                "fsdp2 fp32 CPUOffloadPolicy",
            ),
            "gemini/deepspeed zero3 fp32": ("gemini fp32", "deepspeed zero3 fp32"),
            "gemini/deepspeed zero3 bf16": ("gemini bf16", "deepspeed zero3 bf16"),
        }
        result["ratios"] = {
            label: statistics.median(a / b for a, b in zip(times[ours], times[theirs], strict=True))
            for label, (ours, theirs) in pairs.items()
            if ours in times and theirs in times
        }
        result["depth"] = depth  # type: ignore[assignment]
        Path(out).write_text(json.dumps(result))


def _adam_bench() -> dict[str, float]:
    torch.set_num_threads(1)
    out = {}
    for name, make in (
        ("torch AdamW (default)", lambda p: torch.optim.AdamW([p], lr=1e-3)),
        ("torch AdamW (foreach)", lambda p: torch.optim.AdamW([p], lr=1e-3, foreach=True)),
        ("HybridAdam", lambda p: HybridAdam([p], lr=1e-3)),
    ):
        param = torch.nn.Parameter(torch.randn(ADAM_NUMEL))
        param.grad = torch.randn(ADAM_NUMEL)
        optimizer = make(param)
        optimizer.step()  # state allocation
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            optimizer.step()
            runs.append(time.perf_counter() - start)
        out[name] = 1000 * statistics.median(runs)
        del optimizer, param
    return out


def _peak_live_bytes(prof: torch.profiler.profile, marker: str) -> int:
    """The CPU allocator's largest running total of live tensor bytes after `marker` began (the profiler records
    it with every allocation when `profile_memory=True`; tracked from process start because profiling was on
    before the model was built)."""
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())  # type: ignore[union-attr]
    start, allocations = None, []
    while nodes:
        node = nodes.pop()
        if node.name == marker:
            start = node.start_time_ns
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            allocations.append((node.start_time_ns, node.extra_fields.total_allocated))
        nodes.extend(node.children)
    assert start is not None
    return int(max(total for t, total in allocations if t >= start))


def _peak_worker(rank: int, world_size: int, system: str, dtype: torch.dtype, out: str) -> None:
    """Part 4: one system per pair of processes, profiled from before the model exists; peak of the last step."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step = _fsdp(dtype, offload=False) if system == "fsdp2" else _gemini(dtype, offload=False)[0]
        for _ in range(2):
            step(batch[:, :-1], batch[:, 1:])
        with record_function("measured_step"):
            step(batch[:, :-1], batch[:, 1:])
    if rank == 0:
        Path(out).write_text(json.dumps(_peak_live_bytes(prof, "measured_step")))


def _peak_memory() -> dict[str, float]:
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            for system in ("gemini", "fsdp2"):
                path = str(Path(tmp) / f"{system}-{label}.json")
                spawn(_peak_worker, 2, system, dtype, path, timeout=600)
                peaks[f"{system} {label}"] = float(json.loads(Path(path).read_text()))
    return peaks


def _per_param(row: dict[str, float]) -> str:
    peak = (row["peak_chunk_bytes"] + row["optimizer_state_bytes"]) / row["numel"]
    rest = (row["rest_chunk_bytes"] + row["optimizer_state_bytes"]) / row["numel"]
    return f"{rest:.2f} at rest, {peak:.2f} at peak (chunks + optim state)"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "result.json")
        spawn(_worker, 2, path, timeout=900)
        systems = json.loads(Path(path).read_text())
    ratios = systems.pop("ratios")
    depth = systems.pop("depth")
    print(f"GPT with {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}, world 2")
    for name, row in systems.items():
        line = f"{name:40s} {row['ms']:8.1f} ms"
        if "peak_chunk_bytes" in row:
            line += f"   model data B/param/rank: {_per_param(row)}"
        print(line)
    for name, row in depth.items():
        print(f"depth {name:34s} {row['numel'] / 1e6:6.1f}M params   model data B/param/rank: {_per_param(row)}")
    for label, ratio in ratios.items():
        print(f"ratio {label}: {ratio:.2f} (median of per-round ratios)")
    if BF16_ONLY:
        print(f"load average at the end {os.getloadavg()}")
        return
    peaks = _peak_memory()
    for label in ("fp32", "bf16"):
        ours, theirs = peaks[f"gemini {label}"], peaks[f"fsdp2 {label}"]
        print(
            f"peak live tensor memory per rank, {label}: gemini {ours / 2**20:.1f} MiB, "
            f"fsdp2 {theirs / 2**20:.1f} MiB, ratio {ours / theirs:.2f} "
            "(all tensors: model data, activations, communication buffers)"
        )
    adam = _adam_bench()
    for name, ms in adam.items():
        print(f"{name:40s} {ms:8.1f} ms per step on {ADAM_NUMEL} elements")
    print(f"HybridAdam speed-up vs default AdamW: {adam['torch AdamW (default)'] / adam['HybridAdam']:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
