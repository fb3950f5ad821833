"""Round trips through GeneralCheckpointIO: models, optimizers, schedulers, resumed training, async saves."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from checkpoint_helpers import (
    OPTIMIZERS,
    assert_same_optimizer,
    assert_same_state,
    make_model,
    train,
    tree_bytes,
)
from cx_checkpoint import (
    CheckpointIndexFile,
    CheckpointReader,
    GeneralCheckpointIO,
    LoadResult,
    ModuleSink,
    ModuleSource,
    TensorSpec,
    attach_param_names,
    iter_source,
    load_into,
    write_sharded,
)

LAYOUTS = [
    pytest.param(True, True, "ckpt", id="sharded-safetensors"),
    pytest.param(True, False, "ckpt", id="sharded-bin"),
    pytest.param(False, True, "model.safetensors", id="single-safetensors"),
    pytest.param(False, False, "pytorch_model.bin", id="single-bin"),
]


@pytest.mark.parametrize(("shard", "use_safetensors", "name"), LAYOUTS)
def test_checkpoint_model_round_trip(tmp_path: Path, shard: bool, use_safetensors: bool, name: str) -> None:
    model = make_model(0)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), steps=2, seed=1)
    io = GeneralCheckpointIO()
    if shard:
        io.save_model(model, tmp_path / name, shard=True, use_safetensors=use_safetensors, size_per_shard=0.0005)
    else:
        io.save_model(model, tmp_path / name, use_safetensors=use_safetensors)
    restored = make_model(99)
    result = io.load_model(restored, tmp_path / name)
    assert result == LoadResult()
    assert_same_state(model.state_dict(), restored.state_dict())
    if shard:
        assert len(list((tmp_path / name).glob("*-of-*"))) > 1  # really sharded at 0.0005 MB


def test_checkpoint_model_mixed_dtypes_and_tied_weights(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 12, bias=False)).to(torch.bfloat16)
    model[1].weight = model[0].weight  # tied, as in language models
    model.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    model.register_buffer("scale", torch.randn(3, 5, dtype=torch.float16).t())  # non-contiguous
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "d", shard=True, use_safetensors=True, size_per_shard=0.0001)
    io.save_model(model, tmp_path / "m.safetensors", use_safetensors=True)
    loaded = load_file(tmp_path / "m.safetensors")
    assert_same_state(dict(sorted(model.state_dict().items())), dict(sorted(loaded.items())))
    for source in ("d", "m.safetensors"):
        other = nn.Sequential(nn.Embedding(12, 6), nn.Linear(6, 12, bias=False)).to(torch.bfloat16)
        other[1].weight = other[0].weight
        other.register_buffer("steps", torch.zeros(2, dtype=torch.int64))
        other.register_buffer("scale", torch.zeros(5, 3, dtype=torch.float16))
        io.load_model(other, tmp_path / source)
        assert_same_state(model.state_dict(), other.state_dict())


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "single"])
def test_checkpoint_optimizer_round_trip(tmp_path: Path, kind: str, shard: bool) -> None:
    model = make_model(0)
    optimizer = OPTIMIZERS[kind](model)
    train(model, optimizer, steps=3, seed=2)
    io = GeneralCheckpointIO()
    target = tmp_path / ("optim" if shard else "optim.safetensors")
    if shard:
        io.save_optimizer(optimizer, target, shard=True, size_per_shard=0.001)
    else:
        io.save_optimizer(optimizer, target)
    other_model = make_model(5)
    other = OPTIMIZERS[kind](other_model)
    io.load_optimizer(other, target)
    assert_same_optimizer(optimizer, other)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_checkpoint_resumed_run_equals_uninterrupted(tmp_path: Path, kind: str) -> None:
    model = make_model(0)
    optimizer = OPTIMIZERS[kind](model)
    scheduler = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[2, 4], gamma=0.5)
    train(model, optimizer, steps=3, seed=10, scheduler=scheduler)
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "model", shard=True, use_safetensors=True)
    io.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    io.save_lr_scheduler(scheduler, tmp_path / "scheduler.json")
    train(model, optimizer, steps=3, seed=11, scheduler=scheduler)

    resumed_model = make_model(7)
    resumed_optimizer = OPTIMIZERS[kind](resumed_model)
    resumed_scheduler = torch.optim.lr_scheduler.MultiStepLR(resumed_optimizer, milestones=[1], gamma=0.1)
    io.load_model(resumed_model, tmp_path / "model")
    io.load_optimizer(resumed_optimizer, tmp_path / "optim")
    io.load_lr_scheduler(resumed_scheduler, tmp_path / "scheduler.json")
    train(resumed_model, resumed_optimizer, steps=3, seed=11, scheduler=resumed_scheduler)

    assert_same_state(model.state_dict(), resumed_model.state_dict())
    assert_same_optimizer(optimizer, resumed_optimizer)
    assert scheduler.state_dict() == resumed_scheduler.state_dict()


def test_checkpoint_optimizer_state_keyed_by_name_not_order(tmp_path: Path) -> None:
    """An optimizer listing the same parameters in another order (built without names) restores by name."""
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, steps=2, seed=3)
    io = GeneralCheckpointIO()
    io.save_optimizer(optimizer, tmp_path / "o.safetensors")
    names = json.loads(json.dumps([n for n, _ in model.named_parameters()]))
    other = torch.optim.Adam(list(reversed(list(model.parameters()))), lr=1e-2)
    attach_param_names(other, model)
    assert other.param_groups[0]["param_names"] == list(reversed(names))
    io.load_optimizer(other, tmp_path / "o.safetensors")
    for parameter in model.parameters():
        for key, value in optimizer.state[parameter].items():
            assert torch.equal(value, other.state[parameter][key])


def test_checkpoint_strict_false_reports_keys(tmp_path: Path) -> None:
    small = nn.Sequential(nn.Linear(4, 4))
    io = GeneralCheckpointIO()
    io.save_model(small, tmp_path / "m.safetensors", use_safetensors=True)
    bigger = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    result = io.load_model(bigger, tmp_path / "m.safetensors", strict=False)
    assert result == LoadResult(missing_keys=("1.bias", "1.weight"), unexpected_keys=())
    assert torch.equal(bigger.state_dict()["0.weight"], small.state_dict()["0.weight"])


@pytest.mark.parametrize(("shard", "use_safetensors", "name"), LAYOUTS)
def test_checkpoint_async_save_is_byte_identical(tmp_path: Path, shard: bool, use_safetensors: bool, name: str) -> None:
    model = make_model(0)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    train(model, optimizer, steps=2, seed=4)
    io = GeneralCheckpointIO()
    sync_dir, async_dir = tmp_path / "sync", tmp_path / "async"
    sync_dir.mkdir()
    async_dir.mkdir()
    kwargs: dict[str, Any] = {"shard": shard, "use_safetensors": use_safetensors}
    if shard:
        kwargs["size_per_shard"] = 0.001
    io.save_model(model, sync_dir / name, **kwargs)
    io.save_optimizer(optimizer, sync_dir / "optim.safetensors")
    expected = model.state_dict()
    expected = {k: v.clone() for k, v in expected.items()}
    io.save_model(model, async_dir / name, use_async=True, **kwargs)
    io.save_optimizer(optimizer, async_dir / "optim.safetensors", use_async=True)
    train(model, optimizer, steps=1, seed=5)  # training continues while the writer runs
    io.synchronize()
    assert tree_bytes(sync_dir) == tree_bytes(async_dir)
    restored = make_model(1)
    io.load_model(restored, async_dir / name)
    assert_same_state(expected, restored.state_dict())


def test_checkpoint_resave_replaces_own_files_keeps_others(tmp_path: Path) -> None:
    """Saving again into a directory drops the old shards (even another count/format) but keeps unrelated files."""
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, steps=1, seed=0)
    io = GeneralCheckpointIO()
    target = tmp_path / "ckpt"
    io.save_model(model, target, shard=True, use_safetensors=False, size_per_shard=0.0005)
    io.save_optimizer(optimizer, target, shard=True)
    (target / "tokenizer.json").write_text("{}")
    io.save_model(model, target, shard=True, use_safetensors=True)
    files = sorted(p.name for p in target.iterdir())
    assert files == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "optimizer-00001-of-00001.safetensors",
        "optimizer.json",
        "optimizer.safetensors.index.json",
        "tokenizer.json",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers
    other = make_model(3)
    io.load_model(other, target)
    assert_same_state(model.state_dict(), other.state_dict())


def test_checkpoint_prefixed_files(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    train(model, optimizer, steps=1, seed=0)
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "c", shard=True, use_safetensors=True, prefix="step10", size_per_shard=0.001)
    io.save_optimizer(optimizer, tmp_path / "c", shard=True, prefix="step10")
    names = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert "step10-model.safetensors.index.json" in names
    assert "step10-optimizer.json" in names
    assert all(n.startswith("step10-") for n in names)
    other_model = make_model(1)
    other = torch.optim.SGD(other_model.named_parameters(), lr=0.1, momentum=0.9)
    io.load_model(other_model, tmp_path / "c")
    io.load_optimizer(other, tmp_path / "c", prefix="step10")
    assert_same_state(model.state_dict(), other_model.state_dict())
    assert_same_optimizer(optimizer, other)


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "single"])
def test_checkpoint_optimizer_before_first_step(tmp_path: Path, shard: bool) -> None:
    """An optimizer with no state yet (e.g. saved at step 0) round-trips, and restores as stateless."""
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    io = GeneralCheckpointIO()
    target = tmp_path / ("o" if shard else "o.safetensors")
    io.save_optimizer(optimizer, target, shard=shard)
    other_model = make_model(1)
    other = torch.optim.Adam(other_model.named_parameters(), lr=5.0)
    train(other_model, other, steps=1, seed=0)
    io.load_optimizer(other, target)
    assert other.state_dict()["state"] == {}
    assert other.param_groups[0]["lr"] == 1e-2


def test_checkpoint_protocols_with_a_plain_module(tmp_path: Path) -> None:
    """`ModuleSource` / `ModuleSink` through the public streaming writer, reader and `load_into`."""
    model = make_model(0)
    write_sharded(tmp_path / "c", iter_source(ModuleSource(model), 600), size_per_shard=600 / 2**20)
    other = make_model(1)
    with CheckpointReader.open(tmp_path / "c") as reader:
        assert set(reader.specs) == set(model.state_dict())
        assert reader.specs["fc1.weight"] == TensorSpec((16, 8), torch.float32)
        result = load_into(reader, ModuleSink(other))
    assert result == LoadResult()
    assert_same_state(model.state_dict(), other.state_dict())


def test_checkpoint_index_merge_refuses_overlap() -> None:
    first, second = CheckpointIndexFile(), CheckpointIndexFile()
    first.add("a", "model-00001-of-00002.safetensors", 8)
    second.add("b", "model-00002-of-00002.safetensors", 4)
    merged = CheckpointIndexFile.merge([first, second])
    assert merged.total_size == 12
    assert merged.file_names() == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    clash = CheckpointIndexFile({"a": "model-00002-of-00002.safetensors"}, 8)
    with pytest.raises(ValueError, match="'a' is written by two writers"):
        CheckpointIndexFile.merge([first, clash])


def test_checkpoint_scheduler_state_types_survive(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, total_iters=2),
            torch.optim.lr_scheduler.MultiStepLR(optimizer, [3, 5]),
        ],
        milestones=[2],
    )
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    io = GeneralCheckpointIO()
    io.save_lr_scheduler(scheduler, tmp_path / "s.json")
    fresh_optimizer = torch.optim.SGD(make_model(1).parameters(), lr=1.0)
    fresh = torch.optim.lr_scheduler.SequentialLR(
        fresh_optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(fresh_optimizer, 0.1, total_iters=2),
            torch.optim.lr_scheduler.MultiStepLR(fresh_optimizer, [3, 5]),
        ],
        milestones=[2],
    )
    io.load_lr_scheduler(fresh, tmp_path / "s.json")
    assert fresh.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_checkpoint_sync_save_after_async_save_wins(tmp_path: Path, shard: bool) -> None:
    # an async save still queued when a synchronous save of newer state to the same path runs must not land after
    # it: the path holds what was saved last, and the async save's error-free completion is still reported
    io = GeneralCheckpointIO()
    target = tmp_path / ("ckpt" if shard else "model.safetensors")
    kwargs: dict[str, Any] = {"shard": shard, "use_safetensors": True}
    gate = threading.Event()

    def busy() -> None:  # keeps the writer busy so the async save below stays queued
        gate.wait(timeout=30)

    io._async.submit(busy)
    old, new = make_model(0), make_model(1)
    io.save_model(old, target, use_async=True, **kwargs)
    opener = threading.Timer(0.3, gate.set)
    opener.start()
    io.save_model(new, target, **kwargs)
    io.synchronize()
    opener.join()
    restored = make_model(2)
    io.load_model(restored, target)
    assert_same_state(new.state_dict(), restored.state_dict())


@pytest.mark.parametrize(("shard", "use_safetensors", "name"), LAYOUTS)
def test_checkpoint_async_save_of_tied_weights_is_byte_identical(
    tmp_path: Path, shard: bool, use_safetensors: bool, name: str
) -> None:
    # tied weights (one parameter under two names): staging must keep them tied, or the legacy .bin (which stores
    # shared storages once) differs from the synchronous save's
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(10, 3))
    model[1].weight = model[0].weight
    io = GeneralCheckpointIO()
    kwargs: dict[str, Any] = {"shard": shard, "use_safetensors": use_safetensors}
    if shard:
        kwargs["size_per_shard"] = 0.0002
    for directory, use_async in (("sync", False), ("async", True)):
        (tmp_path / directory).mkdir()
        io.save_model(model, tmp_path / directory / name, use_async=use_async, **kwargs)
    io.synchronize()
    assert tree_bytes(tmp_path / "sync") == tree_bytes(tmp_path / "async")
    restored = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False), nn.Linear(10, 3))
    io.load_model(restored, tmp_path / "async" / name)
    assert_same_state(model.state_dict(), restored.state_dict())


@pytest.mark.parametrize("shard", [False, True])
def test_checkpoint_optimizer_parts_round_trip(tmp_path: Path, shard: bool) -> None:
    """Owners of optimizer state that are not torch optimizers save and load it as (description, tensors)."""
    from cx_checkpoint import OptimizerMeta, optimizer_tensor_name

    moment = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    meta = OptimizerMeta(
        param_groups=[{"lr": 0.1, "betas": (0.9, 0.99), "param_names": ["layer.weight"]}],
        state={
            "layer.weight": {
                "exp_avg": {"tensor": optimizer_tensor_name("layer.weight", "exp_avg")},
                "step": {"value": 3},
            }
        },
    )
    tensors = {optimizer_tensor_name("layer.weight", "exp_avg"): moment}
    io = GeneralCheckpointIO()
    path = tmp_path / ("optimizer" if shard else "optimizer.safetensors")
    io.save_optimizer_parts(meta, tensors, path, shard=shard)
    loaded_meta, loaded = io.load_optimizer_parts(path)
    assert loaded_meta == meta
    assert list(loaded) == list(tensors)
    assert torch.equal(loaded[optimizer_tensor_name("layer.weight", "exp_avg")], moment)
