"""A cx-train checkpoint's config.json carries the tokenizer's real special tokens. The character encoding has none
(its id 0 is the space, once written as EOS, so `generate()` stopped after the first word); a model folder's
tokenizer has its own, which replace the folder config's. Skipped when transformers is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed, run_distributed
from cx_train import CharTokenizer, GrammarText, parse_options
from cx_train._train import run
from train_data_helpers import write_text

transformers = pytest.importorskip("transformers")

TINY = ["--steps", "2", "--batch-size", "2", "--seq-len", "16", "--log-every", "100", "--plugin", "torch_ddp"]


def _saved(folder: Path, name: str) -> dict[str, object]:
    saved: dict[str, object] = json.loads((folder / "model" / name).read_text())
    return saved


@distributed(world_size=1)
def test_train_special_tokens_of_the_character_encoding(rank: int, world_size: int, tmp_path: Path) -> None:
    run(parse_options([*TINY, "--model", "llama", "--hidden-size", "32", "--save", str(tmp_path / "ckpt")]))
    for name in ("config.json", "generation_config.json"):
        saved = _saved(tmp_path / "ckpt", name)
        assert saved.get("eos_token_id") is None, f"{name}: {saved}"
        assert saved.get("bos_token_id") is None, f"{name}: {saved}"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ckpt" / "model"), local_files_only=True)
    prompt = CharTokenizer().encode("The cat ").unsqueeze(0)
    generated = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert generated.shape[1] == prompt.shape[1] + 24, "generate() stopped early: an id of the text is taken as EOS"


def _folder_with_eos(folder: Path) -> int:
    """A tiny Llama whose config says EOS 0 and no pad, with a BPE tokenizer whose EOS is `</s>` (another id) and
    whose pad is `<pad>` (the id after it)."""
    from tokenizers import Tokenizer, models, trainers

    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]", "<s>", "</s>", "<pad>"])
    tokenizer.train_from_iterator([GrammarText(0).generate(5000)], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))
    eos: int = fast.eos_token_id
    assert eos != 0
    assert fast.pad_token_id == eos + 1
    assert config.pad_token_id is None
    return eos


@distributed(world_size=1)
def test_train_special_tokens_of_a_folder_tokenizer(rank: int, world_size: int, tmp_path: Path) -> None:
    eos = _folder_with_eos(tmp_path / "llama")
    dist.barrier()
    run(parse_options([*TINY, "--model", str(tmp_path / "llama"), "--save", str(tmp_path / "ckpt")]))
    for name in ("config.json", "generation_config.json"):
        saved = _saved(tmp_path / "ckpt", name)
        assert saved.get("eos_token_id") == eos, f"{name}: {saved}"
        assert saved.get("bos_token_id") == eos - 1, f"{name}: {saved}"  # <s> precedes </s>
        assert saved.get("pad_token_id") == eos + 1, f"{name}: {saved}"  # <pad> follows it


def _train(rank: int, world_size: int, flags: list[str]) -> None:
    run(parse_options(flags, world_size=world_size))


def test_train_special_tokens_of_the_byte_encoding(tmp_path: Path) -> None:
    """A preset trained on `--data` (UTF-8 bytes, documents ended by id 256) saves EOS 256."""
    data = write_text(tmp_path / "a.txt", 3000)
    flags = [*TINY, "--model", "llama", "--hidden-size", "32", "--data", str(data), "--save", str(tmp_path / "ckpt")]
    parse_options(flags, world_size=1)  # tokenises once, as the launcher does
    run_distributed(_train, 1, flags=flags)
    for name in ("config.json", "generation_config.json"):
        saved = _saved(tmp_path / "ckpt", name)
        assert saved.get("eos_token_id") == 256, f"{name}: {saved}"
        assert saved.get("bos_token_id") is None, f"{name}: {saved}"
