"""Data made inside the data tests (no download): grammar text as plain text / JSON Lines, and a tiny Llama model
folder with a WordLevel fast tokenizer built locally with the `tokenizers` library; and the weights a checkpoint
saved, for comparing two runs' parameters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from cx_train import GrammarText

TINY_GPT = ["--hidden-size", "32", "--num-layers", "1", "--seq-len", "16", "--lr", "3e-3"]


def write_text(path: Path, chars: int, seed: int = 0) -> Path:
    path.write_text(GrammarText(seed).generate(chars))
    return path


def write_jsonl(path: Path, documents: int, seed: int = 0, field: str = "text") -> Path:
    grammar = GrammarText(seed)
    path.write_text("".join(json.dumps({field: grammar.generate(120)}) + "\n" for _ in range(documents)))
    return path


def tiny_llama_folder(folder: Path) -> Path:
    """A 1-layer Llama and a word-level tokenizer (EOS `</s>`) over the grammar's words, saved as a model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text = GrammarText(0).generate(20000)
    words = sorted(set(text.replace(".", " . ").replace("!", " ! ").replace("?", " ? ").split()))
    vocab = {"[UNK]": 0, "</s>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1, bos_token_id=1, pad_token_id=None,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Every parameter of a cx-train checkpoint's model (its safetensors shards), by name."""
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted((checkpoint / "model").glob("*.safetensors")):
        weights.update(load_file(shard))
    assert weights, f"no safetensors shards under {checkpoint / 'model'}"
    return weights


def assert_same_weights(a: Path, b: Path) -> None:
    expected, actual = checkpoint_weights(a), checkpoint_weights(b)
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


CHAT_TEMPLATE = (  # role headers and an end-of-turn token, all special tokens of the word-level tokenizer
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
MARKED_CHAT_TEMPLATE = (  # the same rendering, the assistant's text and end of turn inside generation markers
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}{{ m['content'] }} "
    "<|end|>{% endgeneration %} {% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
CHAT_SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


def tiny_chat_llama_folder(folder: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """`tiny_llama_folder` with role and end-of-turn special tokens and `template` as its chat template."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tiny_llama_folder(folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIALS)})
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(folder))
    config = LlamaConfig.from_pretrained(str(folder))
    config.vocab_size = len(tokenizer)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def chat_record(seed: int, turns: int = 1) -> dict[str, list[dict[str, str]]]:
    """A chat of `turns` user/assistant exchanges of grammar sentences (a system turn first for odd seeds)."""
    grammar = GrammarText(seed)
    messages = [{"role": "system", "content": "be brief"}] if seed % 2 else []
    for _ in range(turns):
        messages += [
            {"role": "user", "content": grammar.sentence()},
            {"role": "assistant", "content": grammar.sentence()},
        ]
    return {"messages": messages}


def write_chat_jsonl(path: Path, records: int, seed: int = 0) -> Path:
    path.write_text("".join(json.dumps(chat_record(seed + i, 1 + (seed + i) % 2)) + "\n" for i in range(records)))
    return path
