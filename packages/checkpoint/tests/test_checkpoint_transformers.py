"""A cx checkpoint directory is a Hugging Face model directory, and HF directories load through cx (skips without
transformers installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cx_checkpoint import GeneralCheckpointIO, LoadResult

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "single"])
def test_checkpoint_from_pretrained_reads_cx_directory(tmp_path: Path, shard: bool) -> None:
    model = _llama()
    io = GeneralCheckpointIO()
    if shard:
        io.save_model(model, tmp_path / "ckpt", shard=True, use_safetensors=True, size_per_shard=0.05)
        assert len(json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    else:
        io.save_model(model, tmp_path / "ckpt" / "model.safetensors", use_safetensors=True)
    assert (tmp_path / "ckpt" / "config.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    expected, found = model.state_dict(), loaded.state_dict()
    assert expected.keys() == found.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, found[name]), name
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, loaded(ids).logits, rtol=0, atol=0)


def test_checkpoint_loads_hugging_face_sharded_directory(tmp_path: Path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    fresh = _llama()
    torch.nn.init.zeros_(fresh.lm_head.weight)
    result = GeneralCheckpointIO().load_model(fresh, tmp_path / "hf")
    assert result == LoadResult()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, fresh.state_dict()[name]), name
