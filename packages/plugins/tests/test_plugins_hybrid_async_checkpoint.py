"""Asynchronous saves (`use_async=True`) under HybridParallelPlugin (tp 2 with ZeRO-1 over dp 2, pp 2) and
MoeHybridParallelPlugin (ep 2 with ZeRO-1): the TP / pipeline / ZeRO / expert gathers run before the save returns,
into copies, so a training step taken while every write is still held back changes nothing in the files. They are
byte for byte those of a synchronous save of the same state (sharded and single-file, model and optimizer), nothing
is visible before the writes finish, and a fresh model and optimizer loaded from them hold that state exactly. A
write that fails on one rank's writer thread raises the same error on every rank (at `synchronize`, at the next
save, at the next load), commits nothing, and training and saving go on."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import CheckpointSaveError, write_sharded
from cx_mesh import all_gather_bytes
from cx_mesh.testing import TEST_ADAM_EPS, distributed, run_distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin, MoeHybridParallelPlugin, OptimizerWrapper
from cx_plugins.hybrid import _save_jobs
from hybrid_test_helpers import batch, llama
from moe_ckpt_helpers import TIMEOUT, mixtral, rows

pytest.importorskip("transformers")

LR = 1e-2
PLUGINS: dict[str, Callable[[], HybridParallelPlugin]] = {
    "tp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"),
    "tp2_dp2_zero1": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zero_stage=1),
    "pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", num_microbatches=2),
    "moe_ep2_zero1": lambda: MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=1),
}
RANKS = {"tp2_dp2_zero1": 4, "pp2": 2, "moe_ep2_zero1": 2}  # the layouts saved while training goes on
Trained = tuple[HybridParallelPlugin, Booster, HybridParallelModule, OptimizerWrapper]


def _boosted(layout: str, scale: float = 1.0) -> Trained:
    plugin = PLUGINS[layout]()
    module = mixtral() if layout.startswith("moe") else llama()
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(scale)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(module, torch.optim.AdamW(module.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert isinstance(model, HybridParallelModule)
    assert optimizer is not None
    return plugin, booster, model, optimizer


def _step(trained: Trained, step: int) -> None:
    plugin, booster, model, optimizer = trained
    ids = rows(step) if isinstance(plugin, MoeHybridParallelPlugin) else batch(step)["input_ids"]
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = len(ids) // dp_size
    mine = ids[dp_rank * share : (dp_rank + 1) * share]
    if plugin.pp_size > 1:
        inputs = iter([{"input_ids": mine, "labels": mine}])
        booster.execute_pipeline(inputs, model, lambda out, _: out.loss, optimizer)
    else:
        booster.backward(model(input_ids=mine, labels=mine).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _save_all(trained: Trained, folder: Path, use_async: bool) -> None:
    """Model and optimizer, sharded (several shard files per rank) and single-file."""
    _, booster, model, optimizer = trained
    options: dict[str, Any] = {"use_async": use_async}
    booster.save_model(model, folder / "model", shard=True, use_safetensors=True, size_per_shard=0.01, **options)
    booster.save_optimizer(optimizer, folder / "optimizer", shard=True, size_per_shard=0.01, **options)
    booster.save_model(model, folder / "single" / "model.safetensors", use_safetensors=True, **options)
    booster.save_optimizer(optimizer, folder / "single" / "optimizer.safetensors", **options)


def _held(model: HybridParallelModule) -> dict[str, torch.Tensor]:
    """Copies of this rank's local parameters (its TP shards, expert slices and pipeline stage)."""
    held = model.held_parameter_names()
    return {n: p.detach().clone() for n, p in model.unwrap().named_parameters() if n in held}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _assert_same_files(expected: Path, got: Path) -> None:
    want, have = _files(expected), _files(got)
    assert sorted(have) == sorted(want), (sorted(want), sorted(have))
    differing = [name for name in want if have[name] != want[name]]
    assert not differing, f"{got} differs from {expected} in {differing}"


def _writer_thread() -> bool:
    return threading.current_thread().name.startswith("cx-checkpoint-writer")


def _hold_writes(patch: pytest.MonkeyPatch) -> threading.Event:
    """Every write job on the writer thread waits until the returned event is set."""
    opened = threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        if _writer_thread():
            assert opened.wait(timeout=TIMEOUT), "the test never let the writes go"
        return write_sharded(*args, **kwargs)

    patch.setattr(_save_jobs, "write_sharded", held)
    return opened


def _async_phase(rank: int, world_size: int, layout: str, directory: str) -> None:
    root = Path(directory)
    trained = _boosted(layout)
    for step in range(2):
        _step(trained, step)
    _save_all(trained, root / "sync", use_async=False)
    at_save = _held(trained[2])
    with pytest.MonkeyPatch.context() as patch:
        opened = _hold_writes(patch)
        _save_all(trained, root / "async", use_async=True)  # returns with every write still held back
        _step(trained, 2)  # the live parameters and optimizer state change under the pending saves
        after = _held(trained[2])
        assert any(not torch.equal(after[n], at_save[n]) for n in at_save), "the step changed nothing: a vacuous test"
        dist.barrier()
        if rank == 0:
            assert not (root / "async").exists(), "nothing is visible before the writes finish"
        dist.barrier()
        opened.set()
        trained[1].synchronize()
    if rank == 0:
        _assert_same_files(root / "sync", root / "async")
        assert not [p.name for p in root.rglob("*") if ".cx-" in p.name], "staging or parts left behind"

    fresh = _boosted(layout, scale=0.5)  # another starting point: only the checkpoint can bring it back
    _, booster, model, optimizer = fresh
    booster.load_model(model, root / "async" / "model")
    booster.load_optimizer(optimizer, root / "async" / "optimizer")
    loaded = _held(model)
    assert sorted(loaded) == sorted(at_save)
    for name, value in at_save.items():
        assert torch.equal(loaded[name], value), f"{name}: not the value it had when the save was made"
    _save_all(fresh, root / "again", use_async=False)  # the loaded optimizer state too, tensor by tensor
    dist.barrier()
    if rank == 0:
        _assert_same_files(root / "sync", root / "again")
    dist.barrier()


@pytest.mark.parametrize("layout", sorted(RANKS))
def test_plugins_hybrid_async_save_holds_the_state_at_the_call(tmp_path: Path, layout: str) -> None:
    run_distributed(_async_phase, RANKS[layout], layout=layout, directory=str(tmp_path), timeout=TIMEOUT)


# ---- a failed write on one rank's writer thread ------------------------------------------------------------------
def _fail_everywhere(save: Callable[[], object], match: str) -> None:
    with pytest.raises(CheckpointSaveError, match=match) as caught:
        save()
    messages = all_gather_bytes(str(caught.value).encode())
    assert len(set(messages)) == 1, f"the ranks raised different errors: {messages}"


@distributed(world_size=2, timeout=TIMEOUT)
def test_plugins_hybrid_async_write_error_raises_on_every_rank(
    rank: int, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tp 2: rank 1's writer thread hits a full disk while writing its shards (rank 0 and the training threads
    write fine). The error is raised once on every rank by whichever comes first: synchronize(), the next save, the
    next load; the failed save commits nothing; afterwards the next asynchronous save is the trained state."""
    trained = _boosted("tp2")
    _, booster, model, optimizer = trained
    _step(trained, 0)
    booster.save_model(model, tmp_path / "good", shard=True, use_safetensors=True)
    real_fsync = os.fsync

    def no_space(fd: int) -> None:
        if _writer_thread():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    if rank == 1:
        monkeypatch.setattr(os, "fsync", no_space)
    full = "No space left on device"
    booster.save_model(model, tmp_path / "a", shard=True, use_safetensors=True, use_async=True)
    _fail_everywhere(booster.synchronize, full)
    booster.synchronize()  # reported once
    booster.save_optimizer(optimizer, tmp_path / "b", use_async=True)
    _fail_everywhere(lambda: booster.save_model(model, tmp_path / "c", shard=True, use_safetensors=True), full)
    booster.save_model(model, tmp_path / "d", shard=True, use_async=True)
    _fail_everywhere(lambda: booster.load_model(model, tmp_path / "good"), full)
    booster.synchronize()  # each failure was reported once
    dist.barrier()
    if rank == 0:
        for name in ("a", "b", "c", "d"):
            assert not (tmp_path / name).exists(), f"{name}: a failed save commits nothing"
        assert not [p.name for p in tmp_path.rglob("*") if ".cx-" in p.name], "staging or parts left behind"
    monkeypatch.undo()

    _step(trained, 1)
    at_save = _held(model)
    booster.save_model(model, tmp_path / "e", shard=True, use_safetensors=True, use_async=True)
    booster.save_optimizer(optimizer, tmp_path / "e-optimizer", shard=True, use_async=True)
    _step(trained, 2)
    booster.load_model(model, tmp_path / "e")  # waits for the pending writes
    for name, value in _held(model).items():
        assert torch.equal(value, at_save[name]), name
    booster.load_optimizer(optimizer, tmp_path / "e-optimizer")
    dist.barrier()
