"""`--model NAME` where NAME is both a built-in model and an existing path: the path wins, as a local folder does in
transformers' `from_pretrained` (and in cx-plan, whose printed commands rely on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cx_train.config._options import parse_options


def test_an_existing_folder_wins_over_the_preset_of_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "llama").mkdir()
    config = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert parse_options(["--model", "llama", "--seq-len", "32", "--nproc", "1"]).model == "./llama"
    monkeypatch.chdir(tmp_path / "llama")
    assert parse_options(["--model", "llama", "--seq-len", "32", "--nproc", "1"]).model == "llama"  # no such path
