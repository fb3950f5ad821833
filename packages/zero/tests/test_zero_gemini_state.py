"""State dicts: full tensors by name out (streamed), full tensors in; optimizer state by parameter name; resuming
from a saved state continues exactly; the cx-checkpoint protocols round-trip through files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import (
    CheckpointKind,
    CheckpointReader,
    TensorSink,
    TensorSource,
    iter_source,
    load_into,
    write_sharded,
)
from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import Reference, assert_state_close, batch, lm_loss, local, make_gpt, train_step

CHUNK = {"chunk_size": 2048}


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _build(seed: int, dtype: torch.dtype = torch.float32) -> tuple[GeminiDDP, GeminiOptimizer]:
    ddp = GeminiDDP(make_gpt(seed), chunk_config_dict=CHUNK, mixed_precision=dtype)
    return ddp, GeminiOptimizer(_adamw(list(ddp.parameters())), ddp, initial_scale=2**8)


def _step(rank: int, world_size: int, ddp: GeminiDDP, optimizer: GeminiOptimizer, step: int) -> None:
    train_step(ddp, optimizer, rank, world_size, step)


@distributed(world_size=(1, 2))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_gemini_state_resume_is_exact(rank: int, world_size: int, dtype: torch.dtype) -> None:
    ddp, optimizer = _build(0, dtype)
    for step in range(2):
        _step(rank, world_size, ddp, optimizer, step)
    if dtype == torch.float16:  # resume after the scale has moved: a lost scaler state must not pass unnoticed
        for _ in range(2):  # hysteresis 2: the second overflow halves the scale
            optimizer.zero_grad()
            x, y = batch(0, world_size)
            loss = lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size))
            optimizer.backward(loss * float("inf"))
            optimizer.step()
        assert optimizer.loss_scale == 2**7
    model_state = ddp.state_dict(only_rank_0=False)
    optim_state = optimizer.state_dict(only_rank_0=False)
    assert all(v.dtype == torch.float32 for v in model_state.values() if v.is_floating_point())  # original dtype
    resumed, resumed_optimizer = _build(7, dtype)
    resumed.load_state_dict(model_state)
    resumed_optimizer.load_state_dict(optim_state)
    assert resumed_optimizer.loss_scale == optimizer.loss_scale
    for step in range(2, 4):
        _step(rank, world_size, ddp, optimizer, step)
        _step(rank, world_size, resumed, resumed_optimizer, step)
        assert_state_close(resumed.state_dict(only_rank_0=False), ddp.state_dict(only_rank_0=False), 0, 0, "resumed")


@distributed(world_size=2)
def test_zero_gemini_state_matches_torch_by_name(rank: int, world_size: int) -> None:
    reference = Reference(make_gpt(), world_size, _adamw)
    ddp, optimizer = _build(0)
    for step in range(2):
        _step(rank, world_size, ddp, optimizer, step)
        reference.step(step)
    state = optimizer.state_dict(only_rank_0=True)
    model_state = ddp.state_dict()  # collective: every rank calls it, only rank 0 gets the tensors
    if rank != 0:
        assert state == {}
        assert model_state == {}
        return
    assert "wte.weight" in model_state
    names = {id(p): n for n, p in reference.master.named_parameters()}
    for param, torch_state in reference.optimizer.state.items():
        ours = state["state"][names[id(param)]]
        assert float(ours["step"]) == float(torch_state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours[key], torch_state[key], rtol=1e-5, atol=1e-7)
    assert state["param_groups"][0]["lr"] == 1e-2
    assert "wte.weight" in state["param_groups"][0]["param_names"]


@distributed(world_size=2)
def test_zero_gemini_state_shards_are_bounded(rank: int, world_size: int) -> None:
    ddp, optimizer = _build(0)
    _step(rank, world_size, ddp, optimizer, 0)
    full = ddp.state_dict(only_rank_0=False)
    pieces = list(ddp.state_dict_shard(max_shard_size=4096, only_rank_0=False))
    assert len(pieces) > 2
    merged: dict[str, torch.Tensor] = {}
    for piece, size in pieces:
        assert size == sum(t.numel() * t.element_size() for t in piece.values()) or "lm_head.weight" in piece
        merged.update(piece)
    assert_state_close(merged, full, 0, 0, "shards")
    optim_pieces = list(optimizer.state_shard(max_shard_size=4096, only_rank_0=False))
    assert len(optim_pieces) > 2
    merged_optim: dict[str, dict[str, torch.Tensor]] = {}
    for piece, _ in optim_pieces:
        for name, entries in piece.items():
            merged_optim.setdefault(name, {}).update(entries)
    assert merged_optim.keys() == optimizer.state_dict(only_rank_0=False)["state"].keys()


@distributed(world_size=2)
def test_zero_gemini_state_checkpoint_protocols(rank: int, world_size: int, tmp_path: Path) -> None:
    ddp, optimizer = _build(0)
    _step(rank, world_size, ddp, optimizer, 0)
    assert isinstance(ddp, TensorSource)
    assert isinstance(ddp, TensorSink)
    assert isinstance(optimizer, TensorSource)
    assert isinstance(optimizer, TensorSink)
    write_sharded(tmp_path / "model", iter_source(ddp, 4096), size_per_shard=0.004, group=dist.group.WORLD)
    fresh, _ = _build(3)
    result = load_into(CheckpointReader.open(tmp_path / "model"), fresh)
    assert result.missing_keys == ()
    assert result.unexpected_keys == ()
    assert_state_close(fresh.state_dict(only_rank_0=False), ddp.state_dict(only_rank_0=False), 0, 0, "checkpoint")


@distributed(world_size=2)
def test_zero_gemini_state_optimizer_checkpoint_protocols(rank: int, world_size: int, tmp_path: Path) -> None:
    ddp, optimizer = _build(0)
    other, other_optimizer = _build(0)
    for step in range(2):
        _step(rank, world_size, ddp, optimizer, step)
    _step(rank, world_size, other, other_optimizer, 5)  # creates state of the same layout, other values
    kind = CheckpointKind.OPTIMIZER
    write_sharded(
        tmp_path / "optim", iter_source(optimizer, 4096), kind=kind, size_per_shard=0.004, group=dist.group.WORLD
    )
    result = load_into(CheckpointReader.open(tmp_path / "optim", kind=kind), other_optimizer)
    assert result.missing_keys == ()
    want = optimizer.state_dict(only_rank_0=False)["state"]
    got = other_optimizer.state_dict(only_rank_0=False)["state"]
    for name, entries in want.items():
        for key, value in entries.items():
            assert torch.equal(got[name][key], value), (name, key)
    meta = optimizer.checkpoint_meta()
    assert meta.state["wte.weight"]["exp_avg"] == {"tensor": "state.wte.weight.exp_avg"}


@distributed(world_size=2)
def test_zero_gemini_state_checkpoint_loads_at_another_world_size(rank: int, world_size: int, tmp_path: Path) -> None:
    """Saved sharded over 2 ranks, loaded by a Gemini model sharded over 1 rank (and vice versa): same tensors."""
    singles = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    ddp, optimizer = _build(0)
    _step(rank, world_size, ddp, optimizer, 0)
    write_sharded(tmp_path / "two", iter_source(ddp, 4096), size_per_shard=0.004, group=dist.group.WORLD)
    single = GeminiDDP(
        make_gpt(4),
        chunk_config_dict={"chunk_size": 1000},
        mixed_precision=torch.bfloat16,
        zero_group=singles[rank],
    )
    load_into(CheckpointReader.open(tmp_path / "two"), single)
    want = ddp.state_dict(only_rank_0=False)
    assert_state_close(single.state_dict(only_rank_0=False), want, 0, 0, "world 2 -> world 1 (bf16 + master)")
    if rank == 0:
        write_sharded(tmp_path / "one", iter_source(single, 4096), size_per_shard=0.004)
    dist.barrier()
    back, _ = _build(9)
    load_into(CheckpointReader.open(tmp_path / "one"), back)
    assert_state_close(back.state_dict(only_rank_0=False), want, 0, 0, "world 1 -> world 2")


@distributed(world_size=1)
@pytest.mark.parametrize("scalars_on_device", [False, True])
def test_zero_gemini_state_scalar_state_stays_on_the_host(rank: int, world_size: int, scalars_on_device: bool) -> None:
    # a loaded `step` goes where torch optimizers keep it: on the host unless capturable/fused (a device scalar
    # would synchronise every step); the meta device stands in for an accelerator here
    from cx_chunk import ChunkConfig, ChunkManager
    from cx_zero.gemini._shards import ShardEntry, own_part

    param = torch.nn.Parameter(torch.zeros(4))
    manager = ChunkManager(ChunkConfig(chunk_size=4))
    chunk = manager.register_tensor(param, name="w")
    manager.close_all_groups()
    holder = torch.nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    entry = ShardEntry(param, holder, "w", chunk, 0, 4, 0, 4)
    step = own_part(entry, torch.tensor(7.0), scalars_on_device=scalars_on_device)
    assert step.device.type == ("meta" if scalars_on_device else "cpu")
    assert own_part(entry, torch.arange(4.0)).device.type == "meta"  # elementwise state follows the shard
