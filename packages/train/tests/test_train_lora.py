"""`--lora-rank`: only peft's adapters train and are saved (in peft's format, with no full weights), `--merge-lora`
also saves the weights with the adapters merged in (base + alpha / rank x B A, exactly), and a LoRA checkpoint
resumes with its adapters and optimizer state; 2 ranks of low_level_zero (ZeRO-2), a plugin whose ranks hold full
weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cx_mesh.testing import run_distributed
from cx_train._train import run
from cx_train.config._options import parse_options
from cx_train.models._spec import build_model, describe_model

RANK, ALPHA = 4, 16
FLAGS = ["--model", "llama", "--plugin", "low_level_zero", "--nproc", "2", "--seq-len", "16", "--batch-size", "2"]
FLAGS += ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lora-targets", "q_proj,v_proj", "--lr", "1e-2"]


def _train(rank: int, world_size: int, flags: list[str]) -> None:
    run(parse_options(flags, world_size=world_size))


def test_train_lora_saves_the_adapters_and_merged_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("peft")
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    flags = [*FLAGS, "--steps", "2", "--merge-lora", "--save", str(first)]
    outcomes = run_distributed(_train, 2, flags=flags)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
    adapters = load_file(first / "adapter" / "adapter_model.safetensors")
    assert adapters
    assert all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert {name.split(".")[-3] for name in adapters} == {"q_proj", "v_proj"}
    config = json.loads((first / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (RANK, ALPHA)
    options = parse_options(FLAGS, world_size=2)
    base = build_model(describe_model(options.model_spec), seed=options.seed).state_dict()
    merged = load_file(first / "model" / "model.safetensors")
    prefix = "base_model.model."
    for name, lora_a in adapters.items():
        if ".lora_A." not in name:
            continue
        lora_b = adapters[name.replace(".lora_A.", ".lora_B.")]
        weight = name.removeprefix(prefix).replace(".lora_A.weight", ".weight")
        expected = base[weight] + (ALPHA / RANK) * lora_b @ lora_a
        # fp32: peft's merge and this sum round the same product and sum once each, a few ulps of |W| < 1
        torch.testing.assert_close(merged[weight], expected, rtol=1e-6, atol=1e-6)
        assert not torch.equal(lora_b, torch.zeros_like(lora_b))  # B starts at 0: two steps moved it
    untouched = "model.layers.0.mlp.up_proj.weight"  # not a target: merged = base
    assert torch.equal(merged[untouched], base[untouched])
    outcomes = run_distributed(
        _train, 2, flags=[*FLAGS, "--steps", "3", "--resume", str(first), "--save", str(resumed)]
    )
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
    assert json.loads((resumed / "trainer.json").read_text())["step"] == 3
    assert not (resumed / "model").exists()  # adapters only, without --merge-lora
    assert load_file(resumed / "adapter" / "adapter_model.safetensors").keys() == adapters.keys()


@pytest.mark.parametrize("plugin", [["--plugin", "hybrid", "--tp", "2"], ["--plugin", "gemini"]])
def test_train_lora_on_sharded_plugins_chat_data(tmp_path: Path, plugin: list[str]) -> None:
    """Issue 34: chat data under LoRA with tensor parallelism (hybrid, tp 2) and with Gemini; 2 steps, adapters
    only, in peft's format (full tensors gathered from the shards), loadable on one process; the checkpoint resumes."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from train_data_helpers import tiny_chat_llama_folder, write_chat_jsonl

    folder = tiny_chat_llama_folder(tmp_path / "model")
    data = write_chat_jsonl(tmp_path / "chats.jsonl", 16)
    save = tmp_path / "ckpt"
    flags = ["--model", str(folder), "--data", str(data), "--seq-len", "63", "--batch-size", "2", "--nproc", "2"]
    flags += [*plugin, "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--steps", "2", "--save", str(save)]
    outcomes = run_distributed(_train, 2, flags=flags)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
    assert not (save / "model").exists()  # the adapters alone
    adapters = load_file(save / "adapter" / "adapter_model.safetensors")
    assert adapters
    assert all(".lora_A." in name or ".lora_B." in name for name in adapters)
    hidden, inter = 32, 64  # tiny_llama_folder's: full (gathered) shapes, not tp slices
    for name, tensor in adapters.items():
        if "o_proj.lora_A" in name or "q_proj.lora_B" in name:
            assert tensor.shape[0 if "lora_B" in name else 1] == hidden, (name, tuple(tensor.shape))
        if "down_proj.lora_A" in name:
            assert tensor.shape[1] == inter, (name, tuple(tensor.shape))
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(folder)), str(save / "adapter"))
    assert loaded(input_ids=torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    # the checkpoint resumes: the adapters (cut again to each rank's slices) and their optimizer state, by name
    resumed = tmp_path / "resumed"
    again = [*flags[: flags.index("--steps")], "--steps", "3", "--resume", str(save), "--save", str(resumed)]
    outcomes = run_distributed(_train, 2, flags=again)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
    assert json.loads((resumed / "trainer.json").read_text())["step"] == 3
    assert load_file(resumed / "adapter" / "adapter_model.safetensors").keys() == adapters.keys()
