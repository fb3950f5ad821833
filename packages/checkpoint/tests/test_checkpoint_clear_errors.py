"""Problems that used to pass silently or surface as raw Python errors: a failed asynchronous save nobody awaited,
a symlink leading out of a checkpoint, `total_size` inf/nan, JSON nested too deeply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from checkpoint_helpers import make_model
from cx_checkpoint import (
    CheckpointIndexError,
    CheckpointKindError,
    CheckpointPathError,
    CorruptShardError,
    GeneralCheckpointIO,
)


def _blocked(tmp_path: Path) -> Path:
    (tmp_path / "blocker").write_text("a file where a directory is needed")
    return tmp_path / "blocker" / "model.safetensors"


@pytest.mark.parametrize("next_save_async", [False, True])
def test_checkpoint_unawaited_async_failure_surfaces_at_next_save(tmp_path: Path, next_save_async: bool) -> None:
    io = GeneralCheckpointIO()
    io.save_model(make_model(0), _blocked(tmp_path), use_safetensors=True, use_async=True)
    io._async.drain()  # the background write has failed by now (nobody awaits it)
    target = tmp_path / "next.safetensors"
    with pytest.raises(OSError) as caught:
        io.save_model(make_model(0), target, use_safetensors=True, use_async=next_save_async)
    assert any("reported at the next save" in note for note in caught.value.__notes__)
    assert not target.exists(), "the next save did not start"
    io.save_model(make_model(0), target, use_safetensors=True, use_async=next_save_async)  # reported once
    io.synchronize()
    assert target.is_file()


def test_checkpoint_unawaited_async_failure_reported_at_exit(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from pathlib import Path
        from torch import nn
        from cx_checkpoint import GeneralCheckpointIO
        io = GeneralCheckpointIO()
        io.save_model(nn.Linear(2, 2), Path({str(_blocked(tmp_path))!r}), use_safetensors=True, use_async=True)
        print("returned", flush=True)
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "returned" in result.stdout
    assert "an asynchronous save failed and its result was never awaited" in result.stderr, result.stderr
    assert "FileExistsError" in result.stderr


def test_checkpoint_symlink_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    io.save_model(make_model(0), tmp_path / "ckpt", shard=True, use_safetensors=True, size_per_shard=1000 / 2**20)
    io.save_model(make_model(1), tmp_path / "other", shard=True, use_safetensors=True, size_per_shard=1000 / 2**20)
    shard = sorted((tmp_path / "ckpt").glob("model-*.safetensors"))[0]
    # a link inside the checkpoint to a file inside it is fine
    os.replace(shard, tmp_path / "ckpt" / "real-shard.safetensors")
    os.symlink("real-shard.safetensors", shard)
    io.load_model(make_model(2), tmp_path / "ckpt")
    # a link that leads outside the checkpoint directory is refused, not followed
    shard.unlink()
    os.symlink(tmp_path / "other" / shard.name, shard)
    with pytest.raises(CheckpointPathError, match=rf"{shard.name} is a symbolic link to .*outside the checkpoint"):
        io.load_model(make_model(2), tmp_path / "ckpt")
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.unlink()
    os.symlink(tmp_path / "other" / "model.safetensors.index.json", index)
    with pytest.raises(CheckpointPathError, match="outside the checkpoint"):
        io.load_model(make_model(2), tmp_path / "ckpt")


@pytest.mark.parametrize("total", ["Infinity", "NaN", "1e999", "-Infinity"])
def test_checkpoint_total_size_not_finite_is_a_clear_error(tmp_path: Path, total: str) -> None:
    io = GeneralCheckpointIO()
    io.save_model(make_model(0), tmp_path / "ckpt", shard=True, use_safetensors=True)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    text = json.dumps(data).replace(f'"total_size": {data["metadata"]["total_size"]}', f'"total_size": {total}')
    index.write_text(text)
    with pytest.raises(CheckpointIndexError, match="total_size") as caught:
        io.load_model(make_model(0), tmp_path / "ckpt")
    assert "Infinity" in str(caught.value) or "NaN" in str(caught.value) or "inf" in str(caught.value)


def test_checkpoint_deeply_nested_json_is_a_clear_error(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    deep = "[" * 100_000 + "]" * 100_000
    io.save_model(make_model(0), tmp_path / "ckpt", shard=True, use_safetensors=True)
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    index.write_text('{"metadata": {"x": ' + deep + '}, "weight_map": {}}')
    with pytest.raises(CheckpointIndexError, match="nested too deeply"):
        io.load_model(make_model(0), tmp_path / "ckpt")
    # inside a safetensors header
    header = ('{"__metadata__": {"a": ' + deep + "}}").encode()
    header += b" " * (-len(header) % 8)
    (tmp_path / "deep.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CorruptShardError, match="nested too deeply"):
        io.load_model(make_model(0), tmp_path / "deep.safetensors")
    # an optimizer description and an LR scheduler file
    (tmp_path / "sched.json").write_text(deep)
    with pytest.raises(CheckpointKindError, match="nested too deeply"):
        io.load_lr_scheduler(None, tmp_path / "sched.json")  # type: ignore[arg-type]
