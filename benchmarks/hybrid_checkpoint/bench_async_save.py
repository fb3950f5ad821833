"""What a checkpoint save costs a training run under HybridParallelPlugin (tp 2 on 2 CPU ranks, fp32, AdamW), saved
synchronously or with `use_async=True`: model and optimizer, sharded safetensors, as cx-train's `--save-every` does.

Each measurement is a window of `--window` training steps. It starts with the save (none, synchronous or
asynchronous) and ends with `booster.synchronize()`, so an asynchronous save's writes are inside it whether they
overlapped the steps or not. The cost of a save is its window's time minus the window without one; "blocking" is how
long the save call held the training loop. On a CPU the writer thread competes with the training for the same
cores, so the overlap is not free; the windows measure what is left. Methods take turns within each round (the
order rotating); each round's windows are compared with the same round's window without a save, median and quartiles
over the rounds after one warm-up round.

    OMP_NUM_THREADS=1 python benchmarks/hybrid_checkpoint/bench_async_save.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from cx_mesh.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tiny models
from bench_models import tiny_llama

METHODS = ("none", "sync", "async")


def _bench(
    rank: int,
    world_size: int,
    hidden: int,
    layers: int,
    vocab: int,
    seq: int,
    batch: int,
    window: int,
    rounds: int,
    out: str,
) -> None:
    from cx_plugins import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=world_size, pp_size=1, precision="fp32")
    module = tiny_llama(layers=layers, hidden=hidden, intermediate=hidden * 8 // 3 // 64 * 64, vocab=vocab, seq=seq)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(module, torch.optim.AdamW(module.parameters(), lr=1e-4))
    assert optimizer is not None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)

    def step() -> None:
        booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()

    def save(folder: Path, use_async: bool) -> Callable[[], None]:
        def run() -> None:
            booster.save_model(model, folder / "model", shard=True, use_safetensors=True, use_async=use_async)
            booster.save_optimizer(optimizer, folder / "optimizer", shard=True, use_async=use_async)

        return run

    def timed_window(saving: Callable[[], None] | None) -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        if saving is not None:
            saving()
        blocking = time.perf_counter() - start
        for _ in range(window):
            step()
        booster.synchronize()
        dist.barrier()
        return time.perf_counter() - start, blocking

    windows: dict[str, list[float]] = {method: [] for method in METHODS}
    blocks: dict[str, list[float]] = {method: [] for method in METHODS}
    for number in range(rounds + 1):  # round 0 warms up (the writer thread and its group are made there)
        order = METHODS[number % 3 :] + METHODS[: number % 3]
        for method in order:
            folder = Path(out, f"{method}{number}")
            saving = None if method == "none" else save(folder, method == "async")
            total, blocking = timed_window(saving)
            if number:
                windows[method].append(total)
                blocks[method].append(blocking)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    if rank == 0:
        params = sum(p.numel() for p in module.parameters())
        base = statistics.median(windows["none"])
        print(f"{params / 1e6:.1f}M parameters, tp {world_size}, {batch}x{seq} tokens a step, {window}-step windows")
        print(f"step (no save): {base / window * 1e3:.0f} ms; window {base:.3f} s; median of {rounds} rounds")
        costs: dict[str, list[float]] = {}
        for method in ("sync", "async"):  # each round's window against the same round's window without a save
            costs[method] = sorted(w - n for w, n in zip(windows[method], windows["none"], strict=True))
            low, _, high = statistics.quantiles(costs[method], n=4) if rounds > 1 else costs[method] * 3
            print(
                f"{method} save: blocks {statistics.median(blocks[method]):.3f} s; costs the window "
                f"{statistics.median(costs[method]):+.3f} s (quartiles {low:+.3f} .. {high:+.3f})"
            )
        print(f"async cost / sync cost: {statistics.median(costs['async']) / statistics.median(costs['sync']):.2f}")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = tempfile.mkdtemp(prefix="cx-async-save-")
    try:
        run_distributed(
            _bench, 2, fresh=True, timeout=1800, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
            seq=args.seq, batch=args.batch, window=args.window, rounds=args.rounds, out=out,
        )  # fmt: skip
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
