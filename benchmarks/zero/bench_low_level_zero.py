"""LowLevelZero stage 1 / 2 vs DDP + AdamW (world 2, CPU, gloo), and HybridAdam vs torch AdamW on a 100M shard.

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zero/bench_low_level_zero.py` (about 1.5 minutes on 2 cores).
Part 1 trains the same GPT-like model (4 layers, hidden 256, 4 heads, vocab 4096, seq 128, micro-batch 8 per rank,
fp32, torch AdamW) with each system side by side in one pair of processes, taking turns step by step so that machine
noise hits all systems alike; it reports the median step time (forward, backward, step, barrier) and the optimizer-state
bytes per rank. Part 2 times one optimizer step on a 100M-element fp32 CPU tensor, 1 thread.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from cx_zero import HybridAdam, LowLevelZeroOptimizer

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 256, 4, 4096, 128, 8
WARMUP, STEPS, ADAM_NUMEL = 2, 16, 100_000_000
if os.environ.get("CX_BENCH_SMOKE"):  # a seconds-long run that only checks the script works
    LAYERS, HIDDEN, VOCAB, SEQ, STEPS, ADAM_NUMEL = 1, 32, 64, 16, 2, 1_000_000


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(torch.randn(SEQ, HIDDEN) * 0.02)
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 4 * HIDDEN, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.mask = nn.Transformer.generate_square_subsequent_mask(SEQ)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        out: torch.Tensor = self.head(self.ln(self.blocks(h, mask=self.mask, is_causal=True)))
        return out


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(-1, 1).reshape(-1))


def _state_bytes(optim: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size() for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    )


def run_ranks(rank: int, world_size: int, out_path: str) -> None:
    torch.manual_seed(0)
    base = GPT()
    systems: dict[str, tuple[nn.Module, object]] = {}
    ddp_model = nn.parallel.DistributedDataParallel(GPT())
    ddp_model.module.load_state_dict(base.state_dict())
    systems["DDP + AdamW"] = (ddp_model, torch.optim.AdamW(ddp_model.parameters(), lr=1e-4))
    variants = (
        ("ZeRO-1", False, "torch", False),
        ("ZeRO-2", True, "torch", False),
        ("ZeRO-2 + HybridAdam", True, "hybrid", False),
        ("ZeRO-2 + HybridAdam + overlap_allgather", True, "hybrid", True),
    )
    for name, stage2, adam, overlap_allgather in variants:
        model = GPT()
        model.load_state_dict(base.state_dict())
        inner = (
            torch.optim.AdamW(model.parameters(), lr=1e-4)
            if adam == "torch"
            else HybridAdam(model.parameters(), lr=1e-4, weight_decay=0.01)
        )
        zero = LowLevelZeroOptimizer(
            inner, partition_grad=stage2, overlap_communication=True, overlap_allgather=overlap_allgather
        )
        systems[name] = (model, zero)
    times: dict[str, list[float]] = {name: [] for name in systems}
    g = torch.Generator().manual_seed(rank)
    names = list(systems)
    for step in range(WARMUP + STEPS):
        for name in names[step % len(names) :] + names[: step % len(names)]:  # rotate who goes first
            net, optim = systems[name]
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            dist.barrier()
            start = time.perf_counter()
            if isinstance(optim, LowLevelZeroOptimizer):
                optim.zero_grad()
                optim.backward(_loss(net, tokens))
                optim.step()
            else:
                assert isinstance(optim, torch.optim.Optimizer)
                optim.zero_grad(set_to_none=True)
                _loss(net, tokens).backward()
                optim.step()
            dist.barrier()
            if step >= WARMUP:
                times[name].append(time.perf_counter() - start)
    result = {}
    params = sum(p.numel() for p in base.parameters())
    for name, (_model, optim) in systems.items():
        if isinstance(optim, LowLevelZeroOptimizer):
            local = optim.local_state_bytes()
            state, master = local["optimizer_state"], local["master"]
        else:
            assert isinstance(optim, torch.optim.Optimizer)
            state, master = _state_bytes(optim), 0
        median_ms = 1000 * statistics.median(times[name])
        # Paired with DDP's step of the same round (adjacent in time), which cancels slow drifts in machine load.
        paired = statistics.median(t / d for t, d in zip(times[name], times["DDP + AdamW"], strict=True))
        result[name] = {"median_ms": median_ms, "paired": paired, "state_bytes": state, "master_bytes": master}
    if rank == 0:
        Path(out_path).write_text(json.dumps({"params": params, "systems": result}))


def bench_adam(numel: int = ADAM_NUMEL, steps: int = 4) -> dict[str, float]:
    torch.set_num_threads(1)
    results = {}
    factories = {
        "torch AdamW (default)": lambda p: torch.optim.AdamW([p], lr=1e-3),
        "torch AdamW (foreach)": lambda p: torch.optim.AdamW([p], lr=1e-3, foreach=True),
        "torch AdamW (fused)": lambda p: torch.optim.AdamW([p], lr=1e-3, fused=True),
        "cx HybridAdam": lambda p: HybridAdam([p], lr=1e-3, weight_decay=0.01),
    }
    for name, factory in factories.items():
        param = torch.zeros(numel, requires_grad=True)
        param.grad = torch.full((numel,), 1e-3)
        optim = factory(param)
        optim.step()
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            optim.step()
            samples.append(time.perf_counter() - start)
        results[name] = 1000 * statistics.median(samples)
        del optim, param
    return results


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_low_level_zero as this  # the spawned ranks import the function by module name

    from cx_mesh.testing import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        spawn(this.run_ranks, 2, out, timeout=600)
        dp = json.loads(Path(out).read_text())
    ddp = dp["systems"]["DDP + AdamW"]
    print(f"GPT-like model, {dp['params'] / 1e6:.2f}M parameters, world 2, fp32, CPU/gloo, 1 thread per rank")
    print(
        "| system | median step ms | ratio of medians | median of paired ratios | optimizer state MB/rank | ratio "
        "| fp32 master MB/rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, row in dp["systems"].items():
        print(
            f"| {name} | {row['median_ms']:.0f} | {row['median_ms'] / ddp['median_ms']:.2f}x | {row['paired']:.2f}x | "
            f"{row['state_bytes'] / 2**20:.1f} | {row['state_bytes'] / ddp['state_bytes']:.3f} | "
            f"{row['master_bytes'] / 2**20:.1f} |"
        )
    adam = bench_adam()
    default = adam["torch AdamW (default)"]
    print(f"\nOne Adam step on a {ADAM_NUMEL / 1e6:.0f}M-element fp32 CPU tensor, 1 thread")
    print("| optimizer | ms/step | speed-up vs default |")
    print("|---|---|---|")
    for name, ms in adam.items():
        print(f"| {name} | {ms:.0f} | {default / ms:.2f}x |")


if __name__ == "__main__":
    main()
