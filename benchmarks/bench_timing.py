"""Step times of several systems measured in turns, shared by the benchmarks that compare them side by side.

Each step index draws one seeded batch; every system runs it between two barriers, so machine noise hits all
systems alike and the ranks start each timed step together. Scripts import it after putting benchmarks/ on
`sys.path`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

Step = Callable[[torch.Tensor], object]


def time_in_turns(
    systems: Mapping[str, Step], batch: Callable[[int], torch.Tensor], warmup: int, steps: int
) -> dict[str, list[float]]:
    """Milliseconds per step of each system over `steps` steps after `warmup`, the systems taking turns step by
    step on `batch(index)`."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for index in range(warmup + steps):
        ids = batch(index)
        for name, step in systems.items():
            dist.barrier()
            start = time.perf_counter()
            step(ids)
            dist.barrier()
            if index >= warmup:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times
