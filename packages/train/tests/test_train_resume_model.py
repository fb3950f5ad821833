"""`--resume` with a checkpoint of a transformers model of another size is refused in one line before any process
starts (it used to start every rank, load, and fail with a tensor-shape traceback), and the same model passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cx_plugins.models import preset_config
from cx_train import parse_options

TINY = ["--nproc", "1", "--plugin", "torch_ddp", "--batch-size", "2", "--seq-len", "16", "--steps", "4"]


def _config(folder: Path, hidden_size: int, num_layers: int = 2) -> Path:
    folder.mkdir(parents=True)
    config = preset_config("llama", vocab_size=256, hidden_size=hidden_size, num_layers=num_layers, seq_len=16)
    config.to_json_file(str(folder / "config.json"))
    return folder / "config.json"


def _checkpoint(tmp_path: Path, model_config: Path) -> Path:
    """A checkpoint's trainer.json and saved model/config.json (all the checks read; no weights are loaded)."""
    checkpoint = tmp_path / "ckpt"
    (checkpoint / "model").mkdir(parents=True)
    state = {"step": 2, "plugin": "torch_ddp", "world_size": 1, "model": str(model_config)}
    (checkpoint / "trainer.json").write_text(json.dumps(state))
    (checkpoint / "model" / "config.json").write_text(model_config.read_text())
    return checkpoint


@pytest.mark.parametrize(
    ("hidden", "layers", "message"),
    [(64, 2, "has hidden_size 32, but --model {} has 64;"), (32, 4, "has num_hidden_layers 2, but --model {} has 4;")],
)
def test_train_resume_model_of_another_size_is_refused(
    tmp_path: Path, hidden: int, layers: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = _checkpoint(tmp_path, _config(tmp_path / "small", 32))
    other = _config(tmp_path / "other", hidden, layers)
    with pytest.raises(SystemExit) as caught:
        parse_options([*TINY, "--model", str(other), "--resume", str(checkpoint)])
    assert caught.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"cx-train: error: --resume {checkpoint}: the checkpoint's model ")
    assert message.format(other) in error


def test_train_resume_model_of_the_same_size_passes(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path, _config(tmp_path / "small", 32))
    same = _config(tmp_path / "copy", 32)
    options = parse_options([*TINY, "--model", str(same), "--resume", str(checkpoint)])
    assert options.resume == checkpoint
