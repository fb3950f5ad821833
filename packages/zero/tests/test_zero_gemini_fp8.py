"""GeminiDDP(fp8_communication=True): every chunk all-gather of parameters and every gradient reduce-scatter travels as
fp8 (cx_mesh.fp8), exactly half the bytes of bf16 plus 4 per scale; the parameters each rank computes with are the
same on every rank; an inf gradient on one rank still makes an fp16 step skip everywhere."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_chunk import Chunk
from cx_mesh.testing import CollectiveBytes, count_collective_bytes, distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import batch, lm_loss, local, make_gpt

SCALE_BYTES = 4
CHUNK = 2048  # elements: the tiny GPT spans several chunks (and chunks of its own), each split over the two ranks


def _wrapped(dtype: torch.dtype, fp8: bool) -> tuple[GeminiDDP, GeminiOptimizer]:
    ddp = GeminiDDP(make_gpt(), chunk_config_dict={"chunk_size": CHUNK}, mixed_precision=dtype, fp8_communication=fp8)
    optimizer = torch.optim.AdamW(list(ddp.parameters()), lr=1e-3)
    return ddp, GeminiOptimizer(optimizer, ddp, initial_scale=2**8, hysteresis=1)


def _step(
    ddp: GeminiDDP, optimizer: GeminiOptimizer, rank: int, world_size: int, step: int, factor: float = 1.0
) -> tuple[CollectiveBytes, list[torch.Tensor]]:
    """One training step: the bytes it handed to collectives, and the weights each Linear computed with."""
    seen: list[torch.Tensor] = []
    handles = [
        m.register_forward_pre_hook(lambda m, _a: seen.append(m.weight.detach().float().clone()))
        for m in ddp.module.modules()
        if isinstance(m, nn.Linear)
    ]
    x, y = batch(step, world_size)
    with count_collective_bytes() as counted:
        optimizer.zero_grad()
        loss = lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)) * factor
        optimizer.backward(loss)
        optimizer.step()
    for handle in handles:
        handle.remove()
    return counted, seen


def _same_on_every_rank(tensors: list[torch.Tensor], what: str) -> None:
    for i, tensor in enumerate(tensors):
        theirs = tensor.clone()
        dist.broadcast(theirs, 0)
        assert torch.equal(tensor, theirs), f"{what}: Linear weight {i} differs from rank 0's"


@distributed(world_size=2)
def test_zero_gemini_fp8_communication_halves_the_bytes(rank: int, world_size: int) -> None:
    """bf16 against fp8, same model and chunks: a chunk's reduce-scatter hands chunk * 2 bytes in bf16 and
    chunk + 4 * group in fp8 (one scale per destination slice, over gloo both are an all-to-all); a gather of a
    chunk's slice slice * 2 against slice + 4. What else the step sends (the norm, the ranks' path check) is the same
    in both, and the weights every rank computes with are identical."""
    counted, issued = {}, {}
    for fp8 in (False, True):
        ddp, optimizer = _wrapped(torch.bfloat16, fp8)
        log: list[tuple[str, int]] = []
        chained = ddp.manager.on_collective  # the driver's path check; each chunk collective is also logged here

        def record(kind: str, chunk: Chunk, log: list[tuple[str, int]] = log, chained: Any = chained) -> None:
            log.append((kind, chunk.chunk_size))
            if chained is not None:
                chained(kind, chunk)

        ddp.manager.on_collective = record
        for step in range(2):
            log.clear()
            counted[fp8], weights = _step(ddp, optimizer, rank, world_size, step)
            _same_on_every_rank(weights, f"fp8 {fp8}, step {step}")
        issued[fp8] = sorted(log)
    assert issued[False] == issued[True]
    gathers = [size for kind, size in issued[True] if kind == "all_gather"]
    reduces = [size for kind, size in issued[True] if kind == "reduce_scatter"]
    assert gathers
    assert reduces
    assert {kind for kind, _ in issued[True]} == {"all_gather", "reduce_scatter"}
    bf16, fp8_bytes = counted[False].by_op, counted[True].by_op
    assert set(bf16) == set(fp8_bytes)
    payload_bf16 = sum(reduces) * 2 + sum(gathers) // world_size * 2
    scales = len(reduces) * world_size + len(gathers)
    assert counted[True].total == counted[False].total - payload_bf16 // 2 + SCALE_BYTES * scales
    # over gloo the reduce-scatters are all-to-alls in both runs: that op alone shows their share
    assert bf16["all_to_all_single"] - fp8_bytes["all_to_all_single"] == sum(reduces) - SCALE_BYTES * world_size * len(
        reduces
    )


@distributed(world_size=2)
def test_zero_gemini_fp8_communication_fp16_overflow_skips_the_step(rank: int, world_size: int) -> None:
    """The inf reaches the other rank's gradient slice through the fp8 reduce-scatter (its slice dequantizes to NaN):
    both ranks skip, keep their parameters and back off the scale; the next finite step trains."""
    ddp, optimizer = _wrapped(torch.float16, True)
    _step(ddp, optimizer, rank, world_size, 0)
    before = ddp.state_dict(only_rank_0=False)
    _step(ddp, optimizer, rank, world_size, 1, factor=float("inf") if rank == 1 else 1.0)
    assert optimizer.loss_scale == 2**7  # backed off: the overflow was seen on both ranks
    after = ddp.state_dict(only_rank_0=False)
    assert all(torch.equal(after[name], value) for name, value in before.items())
    _step(ddp, optimizer, rank, world_size, 2)
    assert any(not torch.equal(ddp.state_dict(only_rank_0=False)[n], v) for n, v in before.items())
