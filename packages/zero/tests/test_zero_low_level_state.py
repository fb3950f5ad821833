"""Full optimizer state by parameter name: save on 2 ranks, load on 4 and continue; streaming shards; masters."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer
from zero_test_helpers import (
    Reference,
    assert_params_close,
    batch,
    clone_model,
    local,
    loss_of,
    make_mlp,
    make_model,
    subgroup,
)

RTOL, ATOL = 1e-5, 1e-6


def _step(rank: int, world_size: int, optimizer: LowLevelZeroOptimizer, model: torch.nn.Module, step: int) -> None:
    x, y = batch("mlp", step, world_size)
    optimizer.zero_grad()
    optimizer.backward(loss_of("mlp", model, local(x, rank, world_size), local(y, rank, world_size)))
    optimizer.step()


@distributed(world_size=4)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_save_on_2_load_on_4_continues_identically(rank: int, world_size: int, stage: int, tmp_path: Path) -> None:
    pair = subgroup((0, 1))
    reference = Reference(make_model("mlp"))
    path = tmp_path / "checkpoint.pt"
    if rank < 2:
        model = make_mlp()
        optimizer = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
            partition_grad=stage == 2,
            dp_process_group=pair,
            module=model,
        )
        for step in range(2):
            _step(rank, 2, optimizer, model, step)
        saved = optimizer.state_dict()
        assert set(saved["state"]) == {name for name, _ in model.named_parameters()}
        assert saved["state"]["fc1.weight"]["exp_avg"].shape == model.fc1.weight.shape
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": saved}, path)
    dist.barrier()
    for step in range(2):
        reference.train_step("mlp", step, 2)
    checkpoint = torch.load(path, weights_only=True)
    model = make_mlp(seed=5)
    model.load_state_dict(checkpoint["model"])
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.5), partition_grad=stage == 2, module=model, reduce_bucket_size=11
    )
    optimizer.load_state_dict(checkpoint["optim"])
    assert optimizer.param_groups[0]["lr"] == 1e-2
    reloaded = optimizer.state_dict()
    for name, entries in checkpoint["optim"]["state"].items():
        for key, value in entries.items():
            assert torch.equal(reloaded["state"][name][key], value), (name, key)
    for step in range(2, 4):
        _step(rank, 4, optimizer, model, step)
        reference.train_step("mlp", step, 4)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
def test_zero_state_shard_streams_pieces(rank: int, world_size: int) -> None:
    model = make_model("mlp")
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), module=model)
    _step(rank, world_size, optimizer, model, 0)
    full = optimizer.state_dict()["state"]
    pieces = list(optimizer.state_shard(prefix="optim.", max_shard_size=1e-4))
    assert len(pieces) == len(full)  # 105 bytes: every parameter's state is a piece of its own
    merged = {k: v for piece, _ in pieces for k, v in piece.items()}
    assert set(merged) == {"optim." + k for k in full}
    for name, entries in full.items():
        assert all(torch.equal(merged["optim." + name][k], v) for k, v in entries.items())
    sizes = [size for _, size in pieces]
    assert sizes[0] == sum(v.numel() * v.element_size() for v in full["fc1.weight"].values())
    one = list(optimizer.state_shard(max_shard_size=1024))
    assert len(one) == 1
    only_zero = list(optimizer.state_shard(only_rank_0=True))
    assert len(only_zero) == (1 if rank == 0 else 0)


@distributed(world_size=2)
def test_zero_update_master_params_after_loading_weights(rank: int, world_size: int) -> None:
    model = make_model("mlp")
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True)
    fresh = make_model("mlp", seed=9)
    model.load_state_dict(fresh.state_dict())
    optimizer.update_master_params(model)
    reference = Reference(clone_model(fresh), weight_decay=0.01)
    reference.optim.param_groups[0]["weight_decay"] = optimizer.param_groups[0]["weight_decay"]
    _step(rank, world_size, optimizer, model, 0)
    reference.train_step("mlp", 0, world_size)
    assert_params_close(model, reference.model, RTOL, ATOL)


@distributed(world_size=2)
def test_zero_maps_and_padding(rank: int, world_size: int) -> None:
    model = make_model("mlp")
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), forced_dtype=torch.bfloat16)
    working_to_master = optimizer.get_working_to_master_map()
    master_to_working = optimizer.get_master_to_working_map()
    padding = optimizer.get_param_padding_map()
    for p in model.parameters():
        assert p.dtype == torch.bfloat16
        master = working_to_master[id(p)]
        assert master.dtype == torch.float32
        assert master_to_working[id(master)] is p
        assert padding[id(p)] == (-p.numel()) % world_size
        assert master.numel() * world_size == p.numel() + padding[id(p)]
        full = torch.nn.functional.pad(p.detach().float().reshape(-1), (0, padding[id(p)]))
        assert torch.equal(master, full.view(world_size, -1)[rank])
    sizes = optimizer.local_state_bytes()
    assert sizes["master"] == sum(m.numel() * 4 for m in working_to_master.values())
    assert sizes["optimizer_state"] == 0


@distributed(world_size=2)
def test_zero_rewrapping_a_model_replaces_the_old_optimizer(rank: int, world_size: int) -> None:
    model = make_model("mlp")
    reference = Reference(clone_model(model))
    LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), partition_grad=True)
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01))
    for step in range(2):
        _step(rank, world_size, optimizer, model, step)
        reference.train_step("mlp", step, world_size)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
def test_zero_fp16_loss_scale_is_saved_and_restored(rank: int, world_size: int) -> None:
    model = make_mlp().half()
    model.register_forward_pre_hook(lambda _m, args: (args[0].half(),))
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), initial_scale=2**10, hysteresis=1)
    x, y = batch("mlp", 0, world_size)
    optimizer.backward(loss_of("mlp", model, local(x, rank, world_size), local(y, rank, world_size)) * float("inf"))
    optimizer.step()
    assert optimizer.loss_scale == 2**9
    saved = optimizer.state_dict()
    again = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), initial_scale=2**10)
    again.load_state_dict(saved)
    assert again.loss_scale == 2**9


@distributed(world_size=2)
def test_zero_loads_a_plain_torch_optimizer_state_dict(rank: int, world_size: int) -> None:
    """A single-process torch AdamW checkpoint (integer keys, full tensors) loads and training continues exactly."""
    reference = Reference(make_model("mlp"))
    reference.train_step("mlp", 0, world_size)
    model = clone_model(reference.model)
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=0.5), partition_grad=True)
    optimizer.load_state_dict(copy.deepcopy(reference.optim.state_dict()))
    for step in (1, 2):
        _step(rank, world_size, optimizer, model, step)
        reference.train_step("mlp", step, world_size)
        assert_params_close(model, reference.model, RTOL, ATOL, f"step {step}")


def _bf16_mlp(seed: int = 0) -> torch.nn.Module:
    model = make_mlp(seed).to(torch.bfloat16)
    model.register_forward_pre_hook(lambda _m, args: (args[0].to(torch.bfloat16),))
    return model


def _assert_masters_match(optimizer: LowLevelZeroOptimizer, model: torch.nn.Module, reference: Reference) -> None:
    masters = optimizer.get_working_to_master_map()
    size, rank = dist.get_world_size(), dist.get_rank()
    for p, ref_master in zip(model.parameters(), reference.masters, strict=True):
        padded = torch.nn.functional.pad(ref_master.detach().reshape(-1), (0, (-p.numel()) % size))
        torch.testing.assert_close(masters[id(p)], padded.view(size, -1)[rank], rtol=RTOL, atol=ATOL)


@distributed(world_size=4)
def test_zero_bf16_resume_from_fp32_masters_on_another_world_size(rank: int, world_size: int, tmp_path: Path) -> None:
    """bf16 with fp32 masters: the state dict carries the full master weights, so 2 -> 4 ranks resumes exactly (a
    resume from the bf16 working weights would restart from masters rounded to 8 bits of mantissa)."""
    pair = subgroup((0, 1))
    reference = Reference(_bf16_mlp())
    path = tmp_path / "checkpoint.pt"
    if rank < 2:
        model = _bf16_mlp()
        optimizer = LowLevelZeroOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
            dp_process_group=pair,
            communication_dtype=torch.float32,
            module=model,
        )
        for step in range(2):
            _step(rank, 2, optimizer, model, step)
        saved = optimizer.state_dict()
        assert saved["state"]["fc1.weight"]["master_weight"].dtype == torch.float32
        if rank == 0:
            torch.save({"model": model.state_dict(), "optim": saved}, path)
    dist.barrier()
    for step in range(2):
        reference.train_step("mlp", step, 2)
    checkpoint = torch.load(path, weights_only=True)
    model = _bf16_mlp(seed=3)
    model.load_state_dict(checkpoint["model"])
    optimizer = LowLevelZeroOptimizer(
        torch.optim.AdamW(model.parameters()), partition_grad=True, communication_dtype=torch.float32, module=model
    )
    optimizer.load_state_dict(checkpoint["optim"])
    _assert_masters_match(optimizer, model, reference)
    for step in range(2, 4):
        _step(rank, 4, optimizer, model, step)
        reference.train_step("mlp", step, 4)
        _assert_masters_match(optimizer, model, reference)
