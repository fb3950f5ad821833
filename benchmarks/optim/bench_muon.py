"""Muon (cx_zero.MuonWithAdamW) vs AdamW under each plugin that takes it: step time and bytes moved per step.

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo .nox/tests/bin/python benchmarks/optim/bench_muon.py` (2 ranks, CPU,
gloo; a few minutes on 2 cores). Every system trains cx's GPT (hidden 256, 4 layers, 4 heads, vocab 512, seq 128,
micro-batch 4 per rank, fp32) from the same seed; the plugins with AdamW and with Muon (the hidden matrices by Muon,
embeddings / norms / biases by AdamW, `muon_param_groups`) take turns step by step (`bench_timing.time_in_turns`),
so machine load hits both alike. Reported per plugin: the median step ms of each, their ratio, and the bytes this
rank hands to collectives in one step (`cx_mesh.testing.count_collective_bytes`): what Muon's whole-matrix step adds
(gradients gathered to an owner, updates scattered back). torch DDP's bucket all-reduce runs inside its C++
reducer, which the counter does not see, so DDP's rows show the bytes of cx's own calls only. TorchFSDPPlugin takes
torch's Muon class only, so its Muon row steps torch.optim.Muon over the 2-D parameters with the rest frozen,
against AdamW over the same parameters. `CX_BENCH_SMOKE=1` runs a seconds-long version that only checks the script
works.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

HIDDEN, LAYERS, VOCAB, SEQ, BATCH, WARMUP, STEPS = 256, 4, 512, 128, 4, 2, 10
if os.environ.get("CX_BENCH_SMOKE"):
    HIDDEN, LAYERS, SEQ, WARMUP, STEPS = 32, 1, 16, 1, 2
PLUGINS = ("torch_ddp", "low_level_zero", "gemini", "hybrid_tp2", "torch_fsdp")


def _plugin(name: str) -> Any:
    from cx_plugins import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    if name == "torch_ddp":
        return TorchDDPPlugin()
    if name == "low_level_zero":
        return LowLevelZeroPlugin(stage=2, precision="fp32")
    if name == "gemini":
        return GeminiPlugin(precision="fp32")
    if name == "hybrid_tp2":
        return HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    return TorchFSDPPlugin()


def _model() -> nn.Module:
    from cx_plugins.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=VOCAB, max_positions=SEQ, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4)
    return GPT(config, seed=0)


def _optimizer(name: str, kind: str, model: nn.Module) -> torch.optim.Optimizer:
    from cx_zero import MuonWithAdamW, muon_param_groups

    if name == "torch_fsdp":  # torch's Muon class only: the 2-D parameters, the rest frozen, for both rows
        for param in model.parameters():
            param.requires_grad_(param.ndim == 2 and param.shape[0] != VOCAB)
        matrices = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.Muon(matrices, lr=0.02) if kind == "muon" else torch.optim.AdamW(matrices, lr=1e-3)
    if kind == "muon":
        return MuonWithAdamW(muon_param_groups(model), lr=0.02, adamw_lr=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _system(name: str, kind: str) -> tuple[Callable[[torch.Tensor], object], Any]:
    from cx_plugins import Booster

    booster = Booster(plugin=_plugin(name))
    plain = _model()
    model, optimizer, *_ = booster.boost(plain, _optimizer(name, kind, plain))
    assert optimizer is not None

    def step(ids: torch.Tensor) -> object:
        loss = model(ids, labels=ids)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step, optimizer


def run_ranks(rank: int, world_size: int, out_path: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_timing import time_in_turns
    from cx_mesh.testing import count_collective_bytes

    def batch(index: int) -> torch.Tensor:  # the same on both ranks: one replica under tp 2, two under the others
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(index))

    results: dict[str, dict[str, float]] = {}
    for name in PLUGINS:
        steps = {kind: _system(name, kind)[0] for kind in ("adamw", "muon")}
        times = time_in_turns(steps, batch, WARMUP, STEPS)
        moved = {}
        for kind, step in steps.items():
            with count_collective_bytes() as counts:
                step(batch(WARMUP + STEPS))
            moved[kind] = counts.total
        adamw, muon = (statistics.median(times[k]) for k in ("adamw", "muon"))
        results[name] = {"adamw_ms": adamw, "muon_ms": muon, "adamw_bytes": moved["adamw"], "muon_bytes": moved["muon"]}
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_muon as this  # the spawned ranks import the function by module name

    from cx_mesh.testing import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        spawn(this.run_ranks, 2, out, timeout=1200)
        results = json.loads(Path(out).read_text())
    print(f"cx GPT hidden {HIDDEN} x {LAYERS} layers, vocab {VOCAB}, seq {SEQ}, batch {BATCH}/rank, fp32, 2 ranks")
    print("| plugin | AdamW ms | Muon ms | Muon / AdamW | AdamW bytes/step | Muon bytes/step | Muon / AdamW |")
    print("|---|---|---|---|---|---|---|")
    for name, row in results.items():
        time_ratio = row["muon_ms"] / row["adamw_ms"]
        byte_ratio = row["muon_bytes"] / row["adamw_bytes"] if row["adamw_bytes"] else float("nan")
        print(
            f"| {name} | {row['adamw_ms']:.1f} | {row['muon_ms']:.1f} | {time_ratio:.2f} | "
            f"{row['adamw_bytes']:,.0f} | {row['muon_bytes']:,.0f} | {byte_ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
