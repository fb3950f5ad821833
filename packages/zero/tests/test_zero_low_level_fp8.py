"""LowLevelZeroOptimizer(fp8_communication=True): each bucket's gradient reduce-scatter and each bucket's parameter
all-gather travel as fp8 (cx_mesh.fp8), exactly half the bytes of bf16 plus 4 per scale; the all-reduce over an
extra data-parallel group likewise; ranks compute with identical parameters; an inf gradient still makes an fp16 step
skip on every rank; the "did any rank use this parameter" flags riding in the buckets survive fp8; and stage 2
frees each fp8 bucket once its reduction has arrived, as it does a bf16 one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import CollectiveBytes, count_collective_bytes, distributed
from cx_zero import LowLevelZeroOptimizer
from cx_zero._partition import ParamShard
from cx_zero._reduce import GroupReducer
from zero_test_helpers import subgroup, world_group

SCALE_BYTES = 4
REDUCE_OPS = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single")  # gloo: an all-to-all


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # odd sizes: every parameter is padded to a multiple of the group size
    return nn.Sequential(nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)


def _data(rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(10 * step + rank)).to(dtype)


def _one_step(
    optimizer: LowLevelZeroOptimizer, model: nn.Module, rank: int, step: int, factor: float = 1.0
) -> tuple[CollectiveBytes, CollectiveBytes]:
    """Bytes handed to collectives by the backward (gradient reduction) and by the step (norm, gather)."""
    optimizer.zero_grad()
    loss = model(_data(rank, step, next(model.parameters()).dtype)).float().square().mean() * factor
    with count_collective_bytes() as backward:
        optimizer.backward(loss)
    with count_collective_bytes() as step_bytes:
        optimizer.step()
    return backward, step_bytes


def _skipped(optimizer: LowLevelZeroOptimizer) -> bool:
    return optimizer.last_step_skipped  # read through a call: mypy would narrow the property between asserts


def _assert_same_on_every_rank(model: nn.Module, what: str) -> None:
    for name, param in model.named_parameters():
        theirs = param.detach().clone()
        dist.broadcast(theirs, 0)
        assert torch.equal(param.detach(), theirs), f"{what}: {name} differs from rank 0's"


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp8_communication_halves_the_bytes(rank: int, world_size: int, stage: int) -> None:
    """bf16 against fp8 on the same model and buckets: the reduce-scatter of a (group, columns) bucket hands
    group * columns * 2 bytes in bf16 and group * columns + 4 * group in fp8 (one scale per destination row); the
    all-gather of a bucket's slice width * 2 against width + 4. The norm's all-reduce is the same in both."""
    counted = {}
    for fp8 in (False, True):
        model = _model(torch.bfloat16)
        optimizer = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            partition_grad=stage == 2,
            reduce_bucket_size=64,  # several buckets
            fp8_communication=fp8,
        )
        for step in range(3):
            counted[fp8] = _one_step(optimizer, model, rank, step)
            _assert_same_on_every_rank(model, f"stage {stage}, fp8 {fp8}, step {step}")
        assert all(m.dtype == torch.float32 for m in optimizer.get_working_to_master_map().values())
    buckets = len(optimizer._reducers[0].buckets)  # type: ignore[union-attr]
    assert buckets >= 3
    (bf16_backward, bf16_step), (fp8_backward, fp8_step) = counted[False], counted[True]
    bf16_reduce = sum(bf16_backward.by_op.get(op, 0) for op in REDUCE_OPS)
    assert bf16_reduce == bf16_backward.total > 0
    assert fp8_backward.by_op == {"all_to_all_single": bf16_reduce // 2 + SCALE_BYTES * world_size * buckets}
    norm = bf16_step.by_op.pop("all_reduce")
    assert fp8_step.by_op.pop("all_reduce") == norm
    ((gather_op, bf16_gather),) = bf16_step.by_op.items()
    assert fp8_step.by_op == {gather_op: bf16_gather // 2 + SCALE_BYTES * buckets}


@distributed(world_size=2)
def test_zero_fp8_communication_over_an_extra_dp_group(rank: int, world_size: int) -> None:
    """A zero group of one rank each and the world as extra_dp_group: the bucket's all-reduce over the replicas is
    fp8's (a reduce-scatter then an all-gather of the reduced slice: half of bf16's bytes for each, plus one scale
    per rank and one), and both replicas keep identical parameters."""
    mine = [subgroup((r,)) for r in range(world_size)][rank]  # new_group is collective: every rank makes each
    counted = {}
    for fp8 in (False, True):
        model = _model(torch.bfloat16)
        optimizer = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            dp_process_group=mine,
            extra_dp_group=world_group(),
            fp8_communication=fp8,
        )
        for step in range(2):
            counted[fp8] = _one_step(optimizer, model, rank, step)[0]
            _assert_same_on_every_rank(model, f"extra dp, fp8 {fp8}, step {step}")
    (bucket,) = optimizer._reducers[0].buckets  # type: ignore[union-attr]
    columns = bucket.width + len(bucket.shards)  # the flat all-reduced in bf16
    assert counted[False].by_op == {"all_reduce": 2 * columns}
    padded = columns + (-columns) % world_size  # fp8 all-reduce pads to the group size
    assert counted[True].by_op == {
        "all_to_all_single": padded + SCALE_BYTES * world_size,
        "all_gather_single": padded // world_size + SCALE_BYTES,
    }


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp8_communication_fp16_overflow_skips_the_step(rank: int, world_size: int, stage: int) -> None:
    """An inf gradient on one rank only: after the compressed reduce every rank still sees it (the fp8 row holding
    it dequantizes to NaN and its flags count as used), skips the step, keeps its parameters and backs off the
    scale; the next finite step trains again."""
    model = _model(torch.float16)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        partition_grad=stage == 2,
        initial_scale=2**8,
        hysteresis=1,
        fp8_communication=True,
    )
    _one_step(optimizer, model, rank, 0)
    assert not _skipped(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    _one_step(optimizer, model, rank, 1, factor=float("inf") if rank == 1 else 1.0)
    assert _skipped(optimizer)
    assert optimizer.loss_scale == 2**7
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    _one_step(optimizer, model, rank, 2)
    assert not _skipped(optimizer)
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    _assert_same_on_every_rank(model, "after the skipped step")


@distributed(world_size=2)
def test_zero_fp8_communication_keeps_the_used_flags(rank: int, world_size: int) -> None:
    """The flag saying a rank produced a gradient rides in the bucket beside gradients of any size: gradients near
    1e12 (a flag of 1 would round to zero in their fp8 row, 1e12 / 57344 per step of the scale) still step every
    parameter, and a parameter no rank used is still skipped as torch skips a None gradient."""
    model = _model(torch.bfloat16)
    unused = nn.Linear(16, 16).to(torch.bfloat16)
    params = [*model.parameters(), *unused.parameters()]
    optimizer = LowLevelZeroOptimizer(torch.optim.SGD(params, lr=1e-14), fp8_communication=True)
    masters = [optimizer.get_working_to_master_map()[id(p)] for p in params]
    before = [m.clone() for m in masters]
    _one_step(optimizer, model, rank, 0, factor=1e12)
    norm = optimizer.get_grad_norm()
    assert norm is not None
    assert norm > 1e9
    changed = [not torch.equal(m, b) for m, b in zip(masters, before, strict=True)]
    assert changed == [True] * len(list(model.parameters())) + [False, False]


def _bucket_bytes_kept_past_a_poll(rank: int, fp8: bool) -> list[int]:
    """One stage-2 backward; for each gradient, the bytes of bucket flats still in flight after the reducer's poll
    that had been launched before it, with a barrier first (on gloo it completes after every collective issued
    before it, so each of those reductions has arrived by the poll)."""
    model = _model(torch.bfloat16)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        partition_grad=True,
        reduce_bucket_size=64,  # several buckets, launched at different gradients
        fp8_communication=fp8,
    )
    reducer = optimizer._reducers[0]
    assert isinstance(reducer, GroupReducer)
    assert len(reducer.buckets) >= 3
    original = reducer.mark_ready
    kept: list[int] = []

    def mark_ready(shard: ParamShard, launch: bool) -> None:
        dist.barrier(group=reducer.group)
        before = {id(item) for item in reducer._in_flight}
        original(shard, launch)
        kept.append(sum(item.flat.nbytes for item in reducer._in_flight if id(item) in before))

    reducer.__dict__["mark_ready"] = mark_ready
    optimizer.zero_grad()
    optimizer.backward(model(_data(rank, 0, torch.bfloat16)).float().square().mean())
    optimizer.step()
    _assert_same_on_every_rank(model, f"fp8 {fp8}")
    return kept


@distributed(world_size=2)
def test_zero_fp8_stage2_frees_each_bucket_once_its_reduction_arrives(rank: int, world_size: int) -> None:
    """Stage 2 polls its in-flight bucket reductions at each gradient and frees (accumulates) those that arrived: no
    bucket may outlive a poll after its reduction arrived, in fp8 as in bf16. Before, cx_mesh's fp8 handles (and the
    plain gloo reduce-scatter's) said "not completed" until waited for, and every bucket, with its full-size flat
    and the collective's buffers, stayed alive to the end of backward."""
    bf16, fp8 = _bucket_bytes_kept_past_a_poll(rank, False), _bucket_bytes_kept_past_a_poll(rank, True)
    assert len(fp8) == len(bf16) > 0
    assert fp8 == bf16 == [0] * len(bf16)
