"""Checksums recorded at save and verified on request: a flipped bit anywhere in a shard is detected by
`verify=True` and by the `cx-checkpoint-verify` command, which also reports checkpoints that carry no checksums."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_helpers import assert_same_state, make_model, train
from cx_checkpoint import (
    CheckpointIndexError,
    ChecksumMismatchError,
    GeneralCheckpointIO,
    VerifyOutcome,
    verify_checkpoints,
)
from cx_checkpoint._verify import main


def _flip_bit(path: Path, from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - from_end] ^= 0x10
    path.write_bytes(bytes(data))


def _save_all(tmp_path: Path) -> Path:
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=0)
    io = GeneralCheckpointIO()
    folder = tmp_path / "run"
    io.save_model(model, folder / "model", shard=True, use_safetensors=True, size_per_shard=1000 / 2**20)
    io.save_model(model, folder / "single" / "model.safetensors", use_safetensors=True)
    io.save_optimizer(optimizer, folder / "optimizer", shard=True, size_per_shard=1000 / 2**20)
    io.save_optimizer(optimizer, folder / "single" / "optimizer.safetensors")
    return folder


@pytest.mark.parametrize("target", ["model", "single/model.safetensors"])
def test_checkpoint_flipped_bit_detected_by_verify(tmp_path: Path, target: str) -> None:
    folder = _save_all(tmp_path)
    io = GeneralCheckpointIO()
    good = make_model(1)
    io.load_model(good, folder / target, verify=True)  # an intact checkpoint verifies
    assert_same_state(good.state_dict(), _loaded(folder / target))
    victim = sorted((folder / target).glob("model-*.safetensors"))[1] if target == "model" else folder / target
    _flip_bit(victim, from_end=3)  # inside the tensor data: the structure stays valid
    io.load_model(make_model(1), folder / target)  # without verify, the rot goes unnoticed (as in safetensors)
    with pytest.raises(ChecksumMismatchError, match=f"{victim.name}: checksum"):
        io.load_model(make_model(1), folder / target, verify=True)


def _loaded(path: Path) -> dict[str, torch.Tensor]:
    model = make_model(2)
    GeneralCheckpointIO().load_model(model, path)
    return model.state_dict()


def test_checkpoint_flipped_bit_in_optimizer_detected(tmp_path: Path) -> None:
    folder = _save_all(tmp_path)
    io = GeneralCheckpointIO()
    for target in ("optimizer", "single/optimizer.safetensors"):
        optimizer = torch.optim.Adam(make_model(0).named_parameters(), lr=1e-2)
        io.load_optimizer(optimizer, folder / target, verify=True)
    _flip_bit(sorted((folder / "optimizer").glob("optimizer-*.safetensors"))[0], from_end=1)
    with pytest.raises(ChecksumMismatchError):
        io.load_optimizer(torch.optim.Adam(make_model(0).named_parameters()), folder / "optimizer", verify=True)


def test_checkpoint_verify_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _save_all(tmp_path)
    assert main([str(folder)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK") == 4, out
    victim = sorted((folder / "model").glob("model-*.safetensors"))[0]
    _flip_bit(victim, from_end=5)
    assert main([str(folder)]) == 1
    out = capsys.readouterr().out
    assert f"FAILED        {folder / 'model' / 'model.safetensors.index.json'}" in out
    assert "ChecksumMismatchError" in out
    assert out.count("OK") == 3

    # the same as `python -m cx_checkpoint verify`
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "cx_checkpoint", "verify", str(folder / "single")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("OK") == 2


def test_checkpoint_without_checksums_is_reported_unverifiable(tmp_path: Path) -> None:
    save_file({"w": torch.ones(3)}, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    torch.save({"w": torch.ones(3)}, tmp_path / "legacy.bin")
    with pytest.raises(CheckpointIndexError, match="cannot be verified"):
        GeneralCheckpointIO().load_model(torch.nn.Module(), tmp_path / "theirs.safetensors", strict=False, verify=True)
    outcomes = {r.path.name: r.outcome for r in verify_checkpoints(tmp_path)}
    assert outcomes == {"theirs.safetensors": VerifyOutcome.UNVERIFIABLE, "legacy.bin": VerifyOutcome.UNVERIFIABLE}
    assert main([str(tmp_path)]) == 2
    assert main([str(tmp_path / "absent")]) == 1
