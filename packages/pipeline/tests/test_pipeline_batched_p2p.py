"""Every pipeline transfer goes through `dist.batch_isend_irecv`, as torch's and Megatron's pipelines post theirs:
separate `isend` / `irecv` calls can deadlock with large messages on NCCL (nothing on CPU can show that, so the test
checks the calls), and the results stay those of one process."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from cx_mesh.testing import distributed
from cx_pipeline import split_model
from pipeline_helpers import (
    ToyNet,
    assert_grads_match,
    batches,
    build_schedule,
    reference_step,
    toy_batch,
    toy_criterion,
)


@contextmanager
def _watched_p2p() -> Iterator[dict[str, int]]:
    """Count batched calls, and the point-to-point calls made outside one of them. The wrappers replace torch's
    functions in both namespaces, since P2POp checks its op against distributed_c10d's own names."""
    counts = {"batches": 0, "unbatched": 0}
    inside = [False]
    names = ("batch_isend_irecv", "isend", "irecv", "send", "recv")
    originals = {name: getattr(c10d, name) for name in names}

    def batched(ops: list[dist.P2POp]) -> Any:
        counts["batches"] += 1
        inside[0] = True
        try:
            return originals["batch_isend_irecv"](ops)
        finally:
            inside[0] = False

    def single(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not inside[0]:
                counts["unbatched"] += 1
            return originals[name](*args, **kwargs)

        return call

    wrappers = {"batch_isend_irecv": batched, **{name: single(name) for name in names[1:]}}
    for name, wrapper in wrappers.items():
        setattr(dist, name, wrapper)
        setattr(c10d, name, wrapper)
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
            setattr(c10d, name, original)


@distributed(world_size=2)
@pytest.mark.parametrize("style", ["1f1b", "interleaved", "zbv"])
def test_pipeline_transfers_are_batched(rank: int, world_size: int, style: str) -> None:
    torch.manual_seed(0)
    full = ToyNet(4, tied=False)
    reference = copy.deepcopy(full)
    with _watched_p2p() as counts:  # P2POp keeps the function it was built with: patch before the model is split
        manager, schedule = build_schedule(style, world_size, 4)
        model = split_model(full, manager)
        for step in range(2):  # the first step probes the shapes, the second runs from the cache
            batch = toy_batch(8, tied=False, as_dict=True, seed=step)
            schedule.forward_backward_step(model, batches(batch), toy_criterion)
            reference_step(reference, batch, 4, toy_criterion)
    assert counts["batches"] > 0, "the pipeline posted no batch_isend_irecv"
    assert counts["unbatched"] == 0, f"{counts['unbatched']} point-to-point calls outside batch_isend_irecv"
    assert assert_grads_match(model, full, reference) > 0
