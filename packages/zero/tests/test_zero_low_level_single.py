"""Groups with one replica: world size 1, and (as MoE builds at moe_dp 1) a size-1 expert group per rank beside the
world group. Their gradients are used in place and, in fp32, their masters are the parameters themselves; every case
is checked against plain torch AdamW on the same model and data, several steps, with and without `no_sync`
accumulation and clipping, in fp32 and bf16."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from functools import partial

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer
from zero_test_helpers import Experts, batch, clone_model, local, loss_of, make_mlp, subgroup, world_group

LR, WD, STEPS = 1e-2, 0.01, 3
CLIP = 0.05  # below every step's gradient norm here, so clipping really scales
# (max relative, max absolute) differences: fp32 differs only in the order the norm's squares are summed; bf16
# masters likewise, and bf16 working parameters are those masters rounded (one bf16 ulp apart at most).
FP32_TOL = (1e-6, 1e-7)
BF16_TOL = (2.0**-7, 1e-3)
ROUTES = {0: [0, 1, 0], 1: [1, 1, 2]}  # rank 0 never routes to its expert 2, rank 1 never to its expert 0


class _Plain:
    """Plain PyTorch on one process: autograd accumulates each micro-batch's gradient in the model's dtype; torch
    AdamW steps the parameters themselves in fp32, fp32 copies of them otherwise (cast back after the step)."""

    def __init__(self, params: Sequence[nn.Parameter], clip: float) -> None:
        self.params = list(params)
        self.mixed = self.params[0].dtype != torch.float32
        self.masters = [p.detach().float().clone() for p in self.params] if self.mixed else self.params
        self.optim = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WD)
        self.clip = clip
        self.norms: list[float] = []

    def step(self, grads: Sequence[torch.Tensor | None]) -> None:
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = None if grad is None else grad.float()
        present = [m for m in self.masters if m.grad is not None]
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(present, self.clip if self.clip else float("inf"))))
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        if self.mixed:
            with torch.no_grad():
                for param, master in zip(self.params, self.masters, strict=True):
                    param.copy_(master)


def _accumulated(params: Sequence[nn.Parameter], losses: Sequence[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    """Each loss's backward into the parameters' `.grad` (accumulating in their dtype, as `no_sync` does)."""
    for p in params:
        p.grad = None
    for loss in losses:
        loss().backward()
    grads = [p.grad if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return grads  # type: ignore[return-value]


def _train(optimizer: LowLevelZeroOptimizer, losses: Sequence[Callable[[], torch.Tensor]]) -> None:
    """One step over the micro-batch `losses`: all but the last backward inside `no_sync`."""
    optimizer.zero_grad()
    for i, loss in enumerate(losses):
        if i < len(losses) - 1:
            with optimizer.no_sync():
                optimizer.backward(loss())
        else:
            optimizer.backward(loss())
    optimizer.step()


def _assert_close(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], tol: tuple[float, float]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        torch.testing.assert_close(a.detach().float(), e.detach().float(), rtol=tol[0], atol=tol[1], msg=f"param {i}")


def _mlp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, count: int = 1) -> torch.Tensor:
    return loss_of("mlp", model, x, y) / count


def _masters_like(optimizer: LowLevelZeroOptimizer, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
    masters = optimizer.get_working_to_master_map()
    return [masters[id(p)].view_as(p) for p in params]


@distributed(world_size=1)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("micro", "clip"), [(1, 0.0), (3, 0.0), (1, CLIP), (3, CLIP)])
def test_zero_world_size_one_matches_plain_torch(
    rank: int, world_size: int, stage: int, dtype: torch.dtype, micro: int, clip: float
) -> None:
    model = make_mlp().to(dtype)
    plain_model = clone_model(model)
    plain = _Plain(list(plain_model.parameters()), clip)
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD), partition_grad=stage == 2, clip_grad_norm=clip
    )
    for step in range(STEPS):
        data = [batch("mlp", 10 * step + m, 1) for m in range(micro)]

        _train(optimizer, [partial(_mlp_loss, model, x.to(dtype), y, micro) for x, y in data])
        plain_losses = [partial(_mlp_loss, plain_model, x.to(dtype), y, micro) for x, y in data]
        plain.step(_accumulated(plain.params, plain_losses))
        norm = optimizer.get_grad_norm()
        assert norm is not None
        assert norm == pytest.approx(plain.norms[-1], rel=1e-5)
        if clip:
            assert plain.norms[-1] > clip, "the test must clip"
        if dtype == torch.float32:
            # one replica, nothing averaged: unclipped it is the same AdamW on the same numbers, bit for bit
            exact = (0.0, 0.0) if not clip else FP32_TOL
            _assert_close(list(model.parameters()), plain.params, exact)
        else:
            _assert_close(_masters_like(optimizer, list(model.parameters())), plain.masters, FP32_TOL)
            _assert_close(list(model.parameters()), plain.params, BF16_TOL)


def _expert_sets() -> tuple[Experts, Experts]:
    """Rank r's experts are set r (different values, as expert parallelism splits them); the dense layer is shared."""
    torch.manual_seed(0)
    first = Experts()
    torch.manual_seed(1)
    second = Experts()
    second.dense = first.dense
    return first, second


def _expert_loss(model: Experts, rank: int, step: int, micro: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = batch("mlp", 10 * step + micro, 2)
    out: torch.Tensor = model(local(x, rank, 2).to(dtype), ROUTES[rank])
    return ((out.float() - local(y, rank, 2)) ** 2).mean() / count


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("micro", "clip", "overlap"), [(1, 0.0, False), (3, CLIP, False), (3, CLIP, True)])
def test_zero_size_one_expert_groups_beside_the_world_group(
    rank: int, world_size: int, stage: int, dtype: torch.dtype, micro: int, clip: float, overlap: bool
) -> None:
    """Dense gradients averaged over both ranks, each rank's experts over their size-1 group (averaged over one);
    the norm (for clipping) spans both, counting every rank's experts once. fp32 communication, so the only
    differences from the reference are in how the norm's squares are summed."""
    sets = tuple(s.to(dtype) for s in _expert_sets())
    unique = list({id(p): p for s in sets for p in s.parameters()}.values())
    plain = _Plain(unique, clip)
    model = copy.deepcopy(sets[rank])
    singles = [subgroup((0,)), subgroup((1,))]  # every rank creates every group
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD),
        pg_to_param_list={world_group(): list(model.dense.parameters()), singles[rank]: model.expert_params()},
        partition_grad=stage == 2,
        clip_grad_norm=clip,
        communication_dtype=torch.float32,
        overlap_communication=overlap,
        overlap_allgather=overlap,
    )
    dense = {id(p) for p in sets[0].dense.parameters()}
    for step in range(STEPS):
        _train(optimizer, [partial(_expert_loss, model, rank, step, m, micro, dtype) for m in range(micro)])
        total: dict[int, torch.Tensor] = {}
        for r in range(2):
            params = list(sets[r].parameters())
            losses = [partial(_expert_loss, sets[r], r, step, m, micro, dtype) for m in range(micro)]
            for p, g in zip(params, _accumulated(params, losses), strict=True):
                if g is not None:
                    g = g.float() / 2 if id(p) in dense else g.float()
                    total[id(p)] = g if id(p) not in total else total[id(p)] + g
        plain.step([total.get(id(p)) for p in unique])
        norm = optimizer.get_grad_norm()
        assert norm is not None
        assert norm == pytest.approx(plain.norms[-1], rel=1e-5)
        mine = list(sets[rank].parameters())
        position = {id(p): i for i, p in enumerate(unique)}
        masters = optimizer.get_working_to_master_map()
        for p, q in zip(model.parameters(), mine, strict=True):  # dense masters are this rank's half, experts whole
            master, expected = masters[id(p)], plain.masters[position[id(q)]].reshape(-1)
            start = rank * master.numel() if id(q) in dense else 0
            expected = torch.nn.functional.pad(expected, (0, master.numel() * 2))[start : start + master.numel()]
            _assert_close([master], [expected], FP32_TOL)
        tolerance = FP32_TOL if dtype == torch.float32 else BF16_TOL
        _assert_close(list(model.parameters()), mine, tolerance)
    # the never-routed expert took no step (as torch skips a parameter without gradient): still its initial value
    unused = model.experts[2 if rank == 0 else 0]
    initial = _expert_sets()[rank].experts[2 if rank == 0 else 0].to(dtype)
    _assert_close(list(unused.parameters()), list(initial.parameters()), (0.0, 0.0))


@distributed(world_size=2)
def test_zero_fp32_single_replica_masters_are_the_parameters(rank: int, world_size: int) -> None:
    """fp32, one replica: the master shard is the parameter's own memory, so no master bytes are held for it; the
    dense parameters (split over 2 ranks) and bf16 or cpu_offload experts keep separate masters."""
    model = copy.deepcopy(_expert_sets()[rank])
    single = [subgroup((0,)), subgroup((1,))][rank]
    experts = model.expert_params()

    def build(cpu_offload: bool = False, dtype: torch.dtype | None = None) -> LowLevelZeroOptimizer:
        return LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=LR),
            pg_to_param_list={world_group(): list(model.dense.parameters()), single: experts},
            cpu_offload=cpu_offload,
            forced_dtype=dtype,
        )

    optimizer = build()
    masters = optimizer.get_working_to_master_map()
    for p in experts:
        assert masters[id(p)].untyped_storage().data_ptr() == p.untyped_storage().data_ptr()
    for p in model.dense.parameters():
        assert masters[id(p)].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    dense_shards = sum(masters[id(p)].numel() * 4 for p in model.dense.parameters())
    assert optimizer.local_state_bytes()["master"] == dense_shards
    expert_bytes = sum(p.numel() * 4 for p in experts)
    assert build(cpu_offload=True).local_state_bytes()["master"] == dense_shards + expert_bytes
    bf16 = build(dtype=torch.bfloat16).get_working_to_master_map()
    for p in experts:
        assert bf16[id(p)].dtype == torch.float32
        assert p.dtype == torch.bfloat16


@distributed(world_size=1)
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_zero_single_replica_state_dict_round_trip(rank: int, world_size: int, cpu_offload: bool) -> None:
    """Save after two steps, load into a fresh model and optimizer, train on: identical to training straight
    through (fp32: no master weights in the state dict, the loaded parameters are the masters)."""
    model = make_mlp()
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), cpu_offload=cpu_offload)

    def step_of(net: nn.Module, opt: LowLevelZeroOptimizer, step: int) -> None:
        x, y = batch("mlp", step, 1)
        _train(opt, [partial(_mlp_loss, net, x, y)])

    for step in range(2):
        step_of(model, optimizer, step)
    saved_state = optimizer.state_dict()
    assert all("master_weight" not in entry for entry in saved_state["state"].values())
    resumed = make_mlp(seed=5)
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(resumed.parameters(), lr=LR), cpu_offload=cpu_offload)
    resumed_optimizer.update_master_params(resumed)
    resumed_optimizer.load_state_dict(saved_state)
    for step in range(2, 4):
        step_of(model, optimizer, step)
        step_of(resumed, resumed_optimizer, step)
    _assert_close(list(resumed.parameters()), list(model.parameters()), (0.0, 0.0))


@distributed(world_size=1)
def test_zero_single_replica_parameter_storage_replaced(rank: int, world_size: int) -> None:
    """A parameter whose storage is replaced after construction (`param.data = ...`) is no longer its master: after
    `update_master_params` the optimizer copies, as it does for a separate master, and training stays right."""
    model = make_mlp()
    plain_model = clone_model(model)
    plain = _Plain(list(plain_model.parameters()), 0.0)
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD))
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
            p.data = p.data * 0.5
            q.mul_(0.5)
    optimizer.update_master_params(model)
    assert optimizer.local_state_bytes()["master"] == sum(p.numel() * 4 for p in model.parameters())
    for step in range(STEPS):
        x, y = batch("mlp", step, 1)
        _train(optimizer, [partial(_mlp_loss, model, x, y)])
        plain.step(_accumulated(plain.params, [partial(_mlp_loss, plain_model, x, y)]))
        _assert_close(list(model.parameters()), plain.params, (0.0, 0.0))
