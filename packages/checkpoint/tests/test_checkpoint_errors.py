"""Every bad input gives a `CheckpointError` (or ValueError/TypeError for bad arguments) naming what is wrong."""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoint_helpers import assert_same_state, make_model, train
from cx_checkpoint import (
    CheckpointError,
    CheckpointIndexError,
    CheckpointKindError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CheckpointReader,
    CorruptShardError,
    GeneralCheckpointIO,
    KeyMismatchError,
    MissingShardError,
    TensorMismatchError,
    UnsafeCheckpointError,
)


class _Exploit:
    """A pickle payload that runs a shell command when unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path: Path, shard: bool = True, use_safetensors: bool = True) -> tuple[nn.Module, Path]:
    model = make_model(0)
    target = tmp_path / ("ckpt" if shard else ("m.safetensors" if use_safetensors else "m.bin"))
    if shard:
        GeneralCheckpointIO().save_model(
            model, target, shard=True, use_safetensors=use_safetensors, size_per_shard=0.0005
        )
    else:
        GeneralCheckpointIO().save_model(model, target, use_safetensors=use_safetensors)
    return model, target


def test_checkpoint_missing_path(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model = make_model(0)
    with pytest.raises(CheckpointNotFoundError, match="does-not-exist"):
        io.load_model(model, tmp_path / "does-not-exist")
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        io.load_optimizer(torch.optim.SGD(model.named_parameters(), lr=1.0), tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match=r"sched\.json"):
        io.load_lr_scheduler(
            torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), 1), tmp_path / "sched.json"
        )
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointIndexError, match="no model checkpoint found"):
        io.load_model(model, tmp_path / "empty")


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "single"])
def test_checkpoint_truncated_file(tmp_path: Path, shard: bool) -> None:
    _, target = _saved(tmp_path, shard=shard)
    victim = sorted(target.glob("model-*.safetensors"))[0] if shard else target
    data = victim.read_bytes()
    victim.write_bytes(data[:-5])
    with pytest.raises(CorruptShardError, match=rf"{victim.name}.*truncated"):
        GeneralCheckpointIO().load_model(make_model(1), target)
    victim.write_bytes(data[:5])
    with pytest.raises(CorruptShardError, match="truncated"):
        GeneralCheckpointIO().load_model(make_model(1), target)
    victim.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CorruptShardError, match="not valid JSON"):
        GeneralCheckpointIO().load_model(make_model(1), target)


def _rewrite_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply `edit` to a safetensors file's JSON header, keeping the data section as it is."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    edit(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


def _bigger_tensor(header: dict[str, Any]) -> str:
    return max((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][1])


def _wrong_shape(header: dict[str, Any]) -> None:
    header[_bigger_tensor(header)]["shape"] = [1]


def _overlap(header: dict[str, Any]) -> None:
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0])
    first, second = header[names[0]], header[names[1]]
    width = first["data_offsets"][1] - first["data_offsets"][0]
    second["dtype"], second["shape"] = first["dtype"], first["shape"]
    second["data_offsets"] = [first["data_offsets"][0], first["data_offsets"][0] + width]


def _read_every_tensor(path: Path) -> None:
    with CheckpointReader.open(path) as reader:
        for name in reader.names():
            reader.read(name)


@pytest.mark.parametrize(
    ("edit", "message"),
    [(_wrong_shape, "inconsistent: shape"), (_overlap, "gap or overlap")],
    ids=["shape-vs-offsets", "overlap"],
)
def test_checkpoint_inconsistent_header(tmp_path: Path, edit: Callable[[dict[str, Any]], None], message: str) -> None:
    # a header whose shapes and offsets disagree is a CorruptShardError naming the file, not a SafetensorError
    # from deep inside safetensors when the tensor is read
    _, target = _saved(tmp_path, shard=False)
    _rewrite_header(target, edit)
    with pytest.raises(CorruptShardError, match=rf"{target.name}.*{message}"):
        _read_every_tensor(target)


@pytest.mark.parametrize("use_safetensors", [True, False], ids=["safetensors", "bin"])
def test_checkpoint_missing_shard(tmp_path: Path, use_safetensors: bool) -> None:
    _, target = _saved(tmp_path, use_safetensors=use_safetensors)
    victim = sorted(target.glob("*-00002-of-*"))[0]
    victim.unlink()
    with pytest.raises(MissingShardError, match=rf"shard file {victim.name} is missing"):
        GeneralCheckpointIO().load_model(make_model(1), target)


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "single"])
def test_checkpoint_shape_and_dtype_mismatch_leave_model_untouched(tmp_path: Path, shard: bool) -> None:
    _, target = _saved(tmp_path, shard=shard)
    wider = make_model(1, hidden=20)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    message = (
        r"tensor 'fc1\.(weight|bias)' is \[16(, 8)?\] float32 in the checkpoint but the model expects \[20(, 8)?\]"
    )
    with pytest.raises(TensorMismatchError, match=message):
        GeneralCheckpointIO().load_model(wider, target)
    assert_same_state(before, wider.state_dict())
    half = make_model(1).to(torch.float16)
    with pytest.raises(TensorMismatchError, match=r"float32 in the checkpoint but the model expects \[.*\] float16"):
        GeneralCheckpointIO().load_model(half, target)


def test_checkpoint_strict_missing_and_unexpected_keys(tmp_path: Path) -> None:
    _, target = _saved(tmp_path)
    model = make_model(1)
    model.extra = nn.Linear(2, 2)
    with pytest.raises(KeyMismatchError, match=r"missing from the checkpoint \(2\): extra.bias, extra.weight") as info:
        GeneralCheckpointIO().load_model(model, target)
    assert info.value.missing == ["extra.bias", "extra.weight"]
    smaller = nn.Sequential()
    smaller.fc1 = nn.Linear(8, 16)
    with pytest.raises(KeyMismatchError, match=r"unexpected in the checkpoint \(\d+\): embed.weight, fc2.bias"):
        GeneralCheckpointIO().load_model(smaller, target, strict=True)


def test_checkpoint_kind_confusion(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=0.1)
    train(model, optimizer, 1, seed=0)
    io = GeneralCheckpointIO()
    io.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    io.save_optimizer(optimizer, tmp_path / "optim.safetensors")
    io.save_model(model, tmp_path / "model", shard=True, use_safetensors=True)
    io.save_model(model, tmp_path / "model.safetensors", use_safetensors=True)
    io.save_model(model, tmp_path / "model.bin")
    with pytest.raises(CheckpointKindError, match="kind 'optimizer'"):
        io.load_model(make_model(1), tmp_path / "optim")
    with pytest.raises(CheckpointKindError, match="holds optimizer state"):
        io.load_model(make_model(1), tmp_path / "optim.safetensors")
    with pytest.raises(CheckpointKindError, match="kind 'model'"):
        io.load_optimizer(optimizer, tmp_path / "model")
    with pytest.raises(CheckpointKindError, match="holds model state"):
        io.load_optimizer(optimizer, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointKindError, match="pickle file"):
        io.load_optimizer(optimizer, tmp_path / "model.bin")
    io.save_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 2), tmp_path / "sched.json")
    with pytest.raises(CheckpointKindError, match="not a cx LR scheduler checkpoint"):
        io.load_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 2), tmp_path / "optim" / "optimizer.json")
    with pytest.raises(CheckpointKindError, match="not JSON"):
        io.load_lr_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 2), tmp_path / "model.bin")


def test_checkpoint_bad_index(tmp_path: Path) -> None:
    _, target = _saved(tmp_path)
    index_path = target / "model.safetensors.index.json"
    good = json.loads(index_path.read_text())
    load = lambda: GeneralCheckpointIO().load_model(make_model(1), target)  # noqa: E731
    index_path.write_text("{truncated")
    with pytest.raises(CheckpointIndexError, match="not valid JSON"):
        load()
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointIndexError, match="no 'weight_map'"):
        load()
    escaping = {**good, "weight_map": {**good["weight_map"], "fc1.weight": "../../etc/passwd"}}
    index_path.write_text(json.dumps(escaping))
    with pytest.raises(CheckpointIndexError, match="not a plain file name"):
        load()
    wrong_total = {**good, "metadata": {"total_size": good["metadata"]["total_size"] + 4}}
    index_path.write_text(json.dumps(wrong_total))
    with pytest.raises(CheckpointIndexError, match=r"total_size is \d+ bytes but the shards hold \d+ bytes"):
        load()
    moved = dict(good["weight_map"])
    first, second = sorted(set(moved.values()))[:2]
    name = next(n for n, f in moved.items() if f == first)
    moved[name] = second
    index_path.write_text(json.dumps({**good, "weight_map": moved}))
    with pytest.raises(CorruptShardError, match=rf"{second}: the index .* places 1 tensor\(s\) in this file"):
        load()


def test_checkpoint_bad_save_arguments(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model = make_model(0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointPathError, match="is a file; a sharded checkpoint is a directory"):
        io.save_model(model, tmp_path / "file", shard=True, use_safetensors=True)
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CheckpointPathError, match="is a directory"):
        io.save_model(model, tmp_path / "dir.safetensors", use_safetensors=True)
    for bad in (0, -1.0, "big", True):
        with pytest.raises(ValueError, match="positive number of MB"):
            io.save_model(model, tmp_path / "s", shard=True, size_per_shard=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cannot be named \*\.index\.json .* pass shard=True"):
        io.save_model(model, tmp_path / "model.safetensors.index.json", use_safetensors=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.safetensors", "file"]


def test_checkpoint_colossalai_call_forms_are_accepted(tmp_path: Path) -> None:
    """What ColossalAI's scripts pass: sharding options with shard=False (a warning, then the unsharded save), an
    optimizer file named like a pickle (cx's safetensors format whatever the suffix, said in a warning), and the
    _sync_d2h / _sync_io names of synchronize()."""
    io = GeneralCheckpointIO()
    model = make_model(0)
    with pytest.warns(UserWarning, match="sharded saves only"):
        io.save_model(model, tmp_path / "m.bin", size_per_shard=10)
    with pytest.warns(UserWarning, match="prefix='x' names the files of a sharded checkpoint"):
        io.save_model(model, tmp_path / "n.bin", prefix="x")
    io.save_model(model, tmp_path / "o.bin", prefix="")  # ColossalAI's default-ish empty prefix: silent
    for name in ("m.bin", "n.bin", "o.bin"):
        loaded = make_model(1)
        io.load_model(loaded, tmp_path / name)
        expected = model.state_dict()
        assert all(torch.equal(value, expected[name]) for name, value in loaded.state_dict().items())
    optimizer = torch.optim.Adam(model.named_parameters(), lr=0.1)
    train(model, optimizer, 1, seed=0)
    with pytest.warns(UserWarning, match="holds cx's format"):
        io.save_optimizer(optimizer, tmp_path / "optim.pt", use_async=True)
    io._sync_d2h()
    io._sync_io()
    assert (tmp_path / "optim.pt").read_bytes()[8:9] == b"{"  # a safetensors header, not a pickle
    restored = torch.optim.Adam(model.named_parameters(), lr=0.5)
    io.load_optimizer(restored, tmp_path / "optim.pt")
    assert restored.param_groups[0]["lr"] == 0.1
    assert all(torch.equal(restored.state[p]["exp_avg"], optimizer.state[p]["exp_avg"]) for p in model.parameters())
    torch.save({"state": {}}, tmp_path / "pickled.pt")  # a real pickle under an optimizer name is refused unread
    with pytest.raises(CheckpointKindError, match="is a pickle file"):
        io.load_optimizer(restored, tmp_path / "pickled.pt")


def test_checkpoint_optimizer_bad_inputs(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model = make_model(0)
    unnamed = torch.optim.Adam(model.parameters(), lr=0.1)
    tensor_lr = torch.optim.Adam(model.named_parameters(), lr=torch.tensor(0.1))
    with pytest.raises(TypeError, match=r"param_groups\[0\].lr is a torch.Tensor"):
        io.save_optimizer(tensor_lr, tmp_path / "o.safetensors")
    named = torch.optim.Adam(model.named_parameters(), lr=0.1)
    train(model, named, 1, seed=0)
    io.save_optimizer(named, tmp_path / "o.safetensors")
    with pytest.raises(ValueError, match="attach_param_names"):  # a name-keyed checkpoint needs names to load
        io.load_optimizer(unnamed, tmp_path / "o.safetensors")
    two_groups = torch.optim.Adam(
        [
            {"params": list(model.fc1.named_parameters(prefix="fc1"))},
            {"params": list(model.fc2.named_parameters(prefix="fc2"))},
        ]
    )
    with pytest.raises(KeyMismatchError, match=r"1 param group\(s\), the optimizer 2"):
        io.load_optimizer(two_groups, tmp_path / "o.safetensors")
    partial = torch.optim.Adam(model.fc1.named_parameters(prefix="fc1"), lr=0.1)
    with pytest.raises(KeyMismatchError, match="unexpected in the checkpoint"):
        io.load_optimizer(partial, tmp_path / "o.safetensors")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_checkpoint_malicious_pickle_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    torch.save({"fc1.weight": torch.ones(2), "evil": _Exploit(marker)}, tmp_path / "zip.bin")
    with (tmp_path / "raw.bin").open("wb") as handle:
        pickle.dump(_Exploit(marker), handle)
    # the format is told by content, so the same pickles under any name (even .safetensors) are refused unrun
    for source, copy in (("zip.bin", "zip"), ("raw.bin", "raw"), ("zip.bin", "zip.safetensors")):
        (tmp_path / copy).write_bytes((tmp_path / source).read_bytes())
    io = GeneralCheckpointIO()
    for name in ("zip.bin", "raw.bin", "zip", "raw", "zip.safetensors"):
        with pytest.raises(UnsafeCheckpointError, match=rf"{name}: refused to load this pickle file"):
            io.load_model(make_model(0), tmp_path / name)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    os.replace(tmp_path / "zip.bin", sharded / "pytorch_model-00001-of-00001.bin")
    index = {"metadata": {"total_size": 8}, "weight_map": {"fc1.weight": "pytorch_model-00001-of-00001.bin"}}
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(UnsafeCheckpointError, match="needs arbitrary code"):
        io.load_model(make_model(0), sharded)
    assert not marker.exists()
    # the unexploited legacy format still loads: a plain state dict saved with torch.save
    model = make_model(3)
    torch.save(model.state_dict(), tmp_path / "plain.bin")
    other = make_model(4)
    io.load_model(other, tmp_path / "plain.bin")
    assert_same_state(model.state_dict(), other.state_dict())


def test_checkpoint_unsharded_model_file_of_any_name(tmp_path: Path) -> None:
    """ColossalAI's booster tests save `f"{tempdir}/model"` with shard=False and load it back: any file name holds
    the format asked for (safetensors or legacy bin), loading tells which by content, and only a suffix naming the
    other format warns."""
    io = GeneralCheckpointIO()
    model = make_model(0)
    cases = [  # file name, use_safetensors, whether the suffix contradicts the format (one warning)
        ("model", False, False),
        ("model_st", True, False),
        ("weights.bin", True, True),
        ("weights.safetensors", False, True),
        ("model.ckpt", True, False),
    ]
    for name, use_safetensors, warns in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            io.save_model(model, tmp_path / name, shard=False, use_safetensors=use_safetensors)
        messages = [str(w.message) for w in caught]
        assert len(messages) == warns, (name, messages)
        assert all("despite its" in m for m in messages), messages
        head = (tmp_path / name).read_bytes()[:9]
        assert (head[8:9] == b"{") if use_safetensors else head.startswith(b"PK\x03\x04"), (name, head)
        loaded = make_model(1)
        result = io.load_model(loaded, tmp_path / name)
        assert not result.missing_keys
        assert not result.unexpected_keys
        assert_same_state(model.state_dict(), loaded.state_dict())
    (tmp_path / "notes").write_text("neither format")
    with pytest.raises(CheckpointPathError, match="notes: not a checkpoint file"):
        io.load_model(make_model(1), tmp_path / "notes")


def test_checkpoint_safetensors_header_starting_like_a_pickle(tmp_path: Path) -> None:
    """A safetensors header of 128 bytes starts with the byte 0x80, which also opens a pickle: still safetensors."""
    value = torch.arange(4, dtype=torch.float32)
    header = json.dumps({"fc1.bias": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    header += b" " * (128 - len(header))
    (tmp_path / "foreign").write_bytes(struct.pack("<Q", 128) + header + bytes(value.view(torch.uint8).tolist()))
    assert (tmp_path / "foreign").read_bytes()[:1] == b"\x80"
    with CheckpointReader.open(tmp_path / "foreign") as reader:
        assert torch.equal(reader.read("fc1.bias"), value)


def test_checkpoint_async_error_raised_by_synchronize(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file where a directory is needed")
    io = GeneralCheckpointIO()
    io.save_model(make_model(0), tmp_path / "blocker" / "model.safetensors", use_safetensors=True, use_async=True)
    with pytest.raises(OSError):
        io.synchronize()
    io.synchronize()  # the error is reported once


def test_checkpoint_errors_share_a_base() -> None:
    for error in (
        CheckpointNotFoundError,
        CheckpointPathError,
        CheckpointIndexError,
        MissingShardError,
        CorruptShardError,
        TensorMismatchError,
        KeyMismatchError,
        CheckpointKindError,
        UnsafeCheckpointError,
    ):
        assert issubclass(error, CheckpointError)
