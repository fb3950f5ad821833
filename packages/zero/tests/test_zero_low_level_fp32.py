"""LowLevelZeroOptimizer in fp32 against the single-process PyTorch reference (tight tolerances)."""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import distributed
from cx_zero import HybridAdam, LowLevelZeroOptimizer
from zero_test_helpers import Reference, assert_params_close, batch, clone_model, local, loss_of, make_model

# fp32: both sides do the same elementwise work; only the order of the cross-rank sum differs (1-2 ulp).
RTOL, ATOL = 1e-5, 1e-6
STEPS = 3


def _train(
    rank: int, world_size: int, kind: str, optimizer: LowLevelZeroOptimizer, model: torch.nn.Module, step: int
) -> None:
    x, y = batch(kind, step, world_size)
    optimizer.zero_grad()
    optimizer.backward(loss_of(kind, model, local(x, rank, world_size), local(y, rank, world_size)))
    optimizer.step()


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("bucket", [5, 10**7])
@pytest.mark.parametrize("overlap", [False, True])
def test_zero_fp32_mlp_matches_reference(rank: int, world_size: int, stage: int, bucket: int, overlap: bool) -> None:
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        reduce_bucket_size=bucket,
        overlap_communication=overlap,
        overlap_allgather=overlap,
    )
    for step in range(STEPS):
        _train(rank, world_size, "mlp", optimizer, model, step)
        optimizer.synchronize_working_params()
        reference.train_step("mlp", step, world_size)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")
        assert optimizer.get_grad_norm() == pytest.approx(reference.last_norm, rel=1e-5)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_fp32_gpt_matches_reference(rank: int, world_size: int, stage: int) -> None:
    model = make_model("gpt")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        reduce_bucket_size=200,
        overlap_communication=True,
    )
    for step in range(STEPS):
        _train(rank, world_size, "gpt", optimizer, model, step)
        reference.train_step("gpt", step, world_size)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_stage1_and_stage2_bit_identical(rank: int, world_size: int, dtype: torch.dtype) -> None:
    models = [make_model("mlp").to(dtype), make_model("mlp").to(dtype)]
    optimizers = [
        LowLevelZeroOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-2), partition_grad=stage2, reduce_bucket_size=9)
        for m, stage2 in zip(models, (False, True), strict=True)
    ]
    for step in range(STEPS):
        for model, optimizer in zip(models, optimizers, strict=True):
            x, y = batch("mlp", step, world_size)
            optimizer.zero_grad()
            xr, yr = local(x, rank, world_size).to(dtype), local(y, rank, world_size)
            optimizer.backward(loss_of("mlp", model, xr, yr))
            optimizer.step()
        for p, q in zip(models[0].parameters(), models[1].parameters(), strict=True):
            assert torch.equal(p, q)


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_cpu_offload_with_hybrid_adam(rank: int, world_size: int, stage: int) -> None:
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.01), partition_grad=stage == 2, cpu_offload=True
    )
    for step in range(STEPS):
        _train(rank, world_size, "mlp", optimizer, model, step)
        reference.train_step("mlp", step, world_size)
        # HybridAdam's fused kernel rounds differently from torch's per-tensor AdamW: a few ulp more.
        assert_params_close(model, reference.model, 1e-5, 1e-5, f"step {step}")
    for master in optimizer.get_working_to_master_map().values():
        assert master.device.type == "cpu"
    for state in optimizer.optim.state.values():
        assert all(v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor))


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_zero_clipping_matches_torch_clip_grad_norm(rank: int, world_size: int, stage: int, norm_type: float) -> None:
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    clip = 0.05 if norm_type == 2.0 else 0.005
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        clip_grad_norm=clip,
        norm_type=norm_type,
    )
    for step in range(STEPS):
        _train(rank, world_size, "mlp", optimizer, model, step)
        reference.train_step("mlp", step, world_size, clip=clip, norm_type=norm_type)
        assert reference.last_norm > clip, "the test must actually clip"
        assert optimizer.get_grad_norm() == pytest.approx(reference.last_norm, rel=1e-5)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_overlap_allgather_updates_params_before_their_module_runs(rank: int, world_size: int, stage: int) -> None:
    """With overlap_allgather the step only starts the all-gathers; they are finished just before the next module
    forward, which sees the updated values without an explicit sync (the lazy path with models that read other
    modules' parameters: test_zero_low_level_overlap.py)."""
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        partition_grad=stage == 2,
        overlap_allgather=True,
        reduce_bucket_size=40,
    )
    for step in range(STEPS):
        reference.train_step("mlp", step, world_size)  # first: any module forward finishes the pending gathers
        before = [p.detach().clone() for p in model.parameters()]
        _train(rank, world_size, "mlp", optimizer, model, step)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True)), "still deferred"
        x, _ = batch("mlp", step + 1, world_size)
        with torch.no_grad():
            out = model(local(x, rank, world_size))
            expected = reference.model(local(x, rank, world_size))
        torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_backward_by_grad_matches_reference(rank: int, world_size: int, stage: int) -> None:
    """A pipeline stage's backward: the upstream gradient of the stage output is given, not a loss."""
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), partition_grad=stage == 2
    )
    for step in range(STEPS):
        x, y = batch("mlp", step, world_size)
        out = model(local(x, rank, world_size))
        detached = out.detach().requires_grad_(True)
        (upstream,) = torch.autograd.grad(((detached - local(y, rank, world_size)) ** 2).mean(), detached)
        optimizer.zero_grad()
        optimizer.backward_by_grad(out, upstream)
        optimizer.step()
        reference.train_step("mlp", step, world_size)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_frozen_parameters_are_left_alone(rank: int, world_size: int, stage: int) -> None:
    model = make_model("mlp")
    for p in model.parameters():
        if p.shape[-1] == 7:  # fc1's weight
            p.requires_grad_(False)
    reference = Reference(clone_model(model))
    frozen = [p.detach().clone() for p in model.parameters() if not p.requires_grad]
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01), partition_grad=stage == 2
    )
    assert len(optimizer.get_working_to_master_map()) == len(list(model.parameters())) - 1
    for step in range(STEPS):
        _train(rank, world_size, "mlp", optimizer, model, step)
        reference.train_step("mlp", step, world_size)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")
    still = [p for p in model.parameters() if not p.requires_grad]
    assert all(torch.equal(p, q) for p, q in zip(still, frozen, strict=True))
