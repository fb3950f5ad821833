"""Loss curves with Adam's moments in fp32 vs bf16 (stochastic rounding), LowLevelZeroPlugin stage 1, CPU.

Run: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/optim/bench_bf16_states.py` (about a minute on 2 cores).
Trains cx-train's demo model (the built-in GPT: hidden 128, 2 layers, 4 heads, seq 64, batch 8, AdamW lr 1e-3, on
the embedded grammar text) for 200 steps from the same seed and data with `optimizer_states_dtype` "fp32" and "bf16",
then prints the final losses (mean of the last 10 steps), the per-step gaps between the curves, and the
optimizer-state bytes per parameter element. A third run (fp32 states, model seed 1) gives the noise yardstick.
One process (world 1, gloo): the states' dtype is what differs between the first two.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

from cx_plugins import Booster, LowLevelZeroPlugin
from cx_plugins.models import GPT, GPTConfig
from cx_train import TokenWindows

STEPS, BATCH, SEQ, HIDDEN, LAYERS, LR = 200, 8, 64, 128, 2, 1e-3
if os.environ.get("CX_BENCH_SMOKE"):  # a seconds-long run that only checks the script works
    STEPS = 5


def run(states: str, windows: TokenWindows, seed: int = 0) -> tuple[list[float], float]:
    config = GPTConfig(
        vocab_size=windows.tokenizer.vocab_size, max_positions=SEQ, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=4
    )
    plain = GPT(config, seed=seed)
    booster = Booster(plugin=LowLevelZeroPlugin(stage=1, precision="fp32", optimizer_states_dtype=states))
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    losses = []
    for step in range(STEPS):
        batch = torch.stack([windows[(step * BATCH + i) % len(windows)] for i in range(BATCH)])
        loss = model(batch, labels=batch)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    numel = sum(p.numel() for p in plain.parameters())
    state_bytes = sum(
        v.numel() * v.element_size()
        for state in optimizer.optim.state.values()
        for k, v in state.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    return losses, state_bytes / numel


def main() -> None:
    with tempfile.TemporaryDirectory() as store:  # gloo removes its rendezvous file itself
        dist.init_process_group("gloo", init_method=f"file://{store}/rendezvous", rank=0, world_size=1)
        windows = TokenWindows(STEPS * BATCH, SEQ, seed=0)
        fp32, fp32_bytes = run("fp32", windows)
        bf16, bf16_bytes = run("bf16", windows)
        noise, _ = run("fp32", windows, seed=1)  # the noise yardstick: fp32 states, another initialisation
        dist.destroy_process_group()
    tail = min(10, STEPS)
    print(f"steps {STEPS}, model hidden {HIDDEN} x {LAYERS} layers, seq {SEQ}, batch {BATCH}, AdamW lr {LR}")
    print(f"first loss            fp32 {fp32[0]:.4f}  bf16 {bf16[0]:.4f}  fp32 seed 1 {noise[0]:.4f}")
    final = [sum(curve[-tail:]) / tail for curve in (fp32, bf16, noise)]
    print(f"final loss (last {tail:2d})  fp32 {final[0]:.4f}  bf16 {final[1]:.4f}  fp32 seed 1 {final[2]:.4f}")
    for name, other in (("bf16 states", bf16), ("fp32 seed 1", noise)):
        gaps = [abs(a - b) for a, b in zip(fp32, other, strict=True)]
        worst = max(range(STEPS), key=lambda i: gaps[i])
        windows_gap = [abs(sum(fp32[i : i + tail]) - sum(other[i : i + tail])) / tail for i in range(0, STEPS, tail)]
        print(
            f"vs fp32: {name}  max |gap| per step {gaps[worst]:.4f} at step {worst}, "
            f"mean |gap| {sum(gaps) / STEPS:.4f}, max |gap| of {tail}-step means {max(windows_gap):.4f}"
        )
    print(f"moment bytes / parameter element: fp32 {fp32_bytes:.1f}  bf16 {bf16_bytes:.1f}")
    for step in range(0, STEPS, max(1, STEPS // 10)):
        print(f"step {step:3d}  fp32 {fp32[step]:.4f}  bf16 {bf16[step]:.4f}  fp32 seed 1 {noise[step]:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
