"""Per-action costs of the pipeline benchmark's stages, one process: forward, whole backward, and the zero-bubble
split backward (input-gradient pass I, weight-gradient pass W) of cx and of torch.distributed.pipelining.

Run: `OMP_NUM_THREADS=1 .nox/tests/bin/python benchmarks/pipeline/bench_actions.py` (about 30 s). The stage
bodies are `bench_pipeline`'s (from `bench_pipeline_model`) with two layers each (its 2-stage V and interleaved
chunks): the first virtual stage (embedding, no input gradient: its W is the whole backward), a middle one, and the
last (final norm, head, loss).
cx and torch alternate action by action and the medians over many repeats are reported, so machine load hits both.
`bench_pipeline` uses `measure_costs` to simulate cx's and torch's action orders with these costs.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_pipeline_model import HIDDEN, MICRO, SEQ, VOCAB, StageBody, lm_loss
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from cx_pipeline import Action, ActionKind
from cx_pipeline._backward_split import backward_input

POSITIONS = ("first", "middle", "last")
REPEATS = 30


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _measure_position(position: str, repeats: int) -> dict[str, float]:
    first, last = position == "first", position == "last"
    body = StageBody(2, first, last)
    params = list(body.parameters())
    tokens = torch.randint(0, VOCAB, (MICRO, SEQ))
    targets = torch.randint(0, VOCAB, (MICRO, SEQ))
    samples: dict[str, list[float]] = {k: [] for k in ("F", "B", "I", "W", "torch_I", "torch_W")}

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = body(x)
        return lm_loss(out, targets) if last else out

    def fresh_input() -> torch.Tensor:
        return tokens if first else torch.randn(MICRO, SEQ, HIDDEN, requires_grad=True)

    def split(system: str, grad: torch.Tensor) -> tuple[float, float]:
        x = fresh_input()
        out = forward(x)
        inputs = [] if first else [x]
        if system == "cx":
            (_, weight), took_i = _timed(lambda: backward_input([out], [grad], inputs, params))
            return took_i, _timed(weight.run)[1]
        (_, groups), took_i = _timed(lambda: stage_backward_input([out], [grad], inputs, iter(params)))
        return took_i, _timed(lambda: stage_backward_weight(iter(params), groups))[1]

    for step in range(repeats + 3):
        x = fresh_input()
        out, took = _timed(functools.partial(forward, x))
        grad = torch.ones_like(out) if last else torch.randn_like(out)
        _, whole = _timed(functools.partial(torch.autograd.backward, [out], [grad]))
        # torch's split needs an input that requires grad: it does not apply to the first virtual stage
        systems = ["cx"] if first else ["cx", "torch"] if step % 2 == 0 else ["torch", "cx"]
        timings = {system: split(system, grad) for system in systems}
        body.zero_grad(set_to_none=True)
        if step < 3:
            continue
        samples["F"].append(took)
        samples["B"].append(whole)
        for system, (took_i, took_w) in timings.items():
            prefix = "" if system == "cx" else "torch_"
            samples[prefix + "I"].append(took_i)
            samples[prefix + "W"].append(took_w)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items() if v}


def measure_costs(repeats: int = REPEATS) -> dict[str, dict[str, float]]:
    """Median milliseconds per action: {position: {F, B, I, W (cx), torch_I, torch_W}}."""
    torch.manual_seed(0)
    return {position: _measure_position(position, repeats) for position in POSITIONS}


def cost_model(costs: dict[str, dict[str, float]], num_virtual: int) -> Callable[[Action], float]:
    """`simulate`'s cost function from `measure_costs` (cx's I and W for split backwards)."""
    keys = {
        ActionKind.FORWARD: "F",
        ActionKind.BACKWARD: "B",
        ActionKind.BACKWARD_INPUT: "I",
        ActionKind.BACKWARD_WEIGHT: "W",
    }

    def cost(action: Action) -> float:
        v = action.virtual_stage
        position = "first" if v == 0 else "last" if v == num_virtual - 1 else "middle"
        return costs[position][keys[action.kind]]

    return cost


def main() -> None:
    torch.set_num_threads(1)
    costs = measure_costs()
    print("| virtual stage | F | B (whole) | cx I | cx W | cx I+W | torch I | torch W | torch I+W |")
    print("|---|---|---|---|---|---|---|---|---|")
    for position, c in costs.items():
        torch_cols = (
            f"{c['torch_I']:.1f} | {c['torch_W']:.1f} | {c['torch_I'] + c['torch_W']:.1f}"
            if "torch_I" in c
            else "- | - | -"
        )
        print(
            f"| {position} | {c['F']:.1f} | {c['B']:.1f} | {c['I']:.1f} | {c['W']:.1f} | {c['I'] + c['W']:.1f} | "
            f"{torch_cols} |"
        )


if __name__ == "__main__":
    main()
