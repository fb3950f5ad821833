"""Packed chat SFT against unpacked padding: the fraction of each window that is padding, and trained target tokens
per second, on the same chats, the same model and the same batch size.

The chats (1-4 user/assistant exchanges of grammar sentences) are tokenised into cx-train's token cache with a
word-level tokenizer and a chat template built here. Packed: cx-train's layout (`packed_windows`, whole chats in
order, the rest padding), called as cx-train calls a transformers model (`input_ids`, `labels`, `position_ids`,
`use_cache=False`: a block-diagonal causal mask per window). Unpacked: one chat per window padded to the window length,
called with an attention mask over the padding (the usual padded SFT batch). A small Llama (sdpa), AdamW, one epoch
of each after a warm-up; target tokens/s counts only the assistant tokens the loss is a mean over.

Run: OMP_NUM_THREADS=1 python benchmarks/data/bench_packing.py [--chats 800] [--window 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from cx_train import GrammarText
from cx_train.data._packing import IGNORE, Layout, build_batch, document_bounds, packed_windows
from cx_train.data._token_cache import TokenStream, token_stream
from cx_train.data._tokenizers import HFStreamTokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def chat_folder(folder: Path) -> Path:
    """A word-level fast tokenizer over the grammar's words with role tokens and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = GrammarText(0).generate(20000)
    words = sorted(set(text.replace(".", " . ").replace("!", " ! ").replace("?", " ? ").split()))
    vocab = {"[UNK]": 0, "</s>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>", "<|end|>"]})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(folder))
    return folder


def write_chats(path: Path, count: int) -> Path:
    grammar, chooser = GrammarText(1), random.Random(2)
    lines = []
    for _ in range(count):
        messages = []
        for _ in range(chooser.randint(1, 4)):
            prompt = "".join(grammar.sentence() for _ in range(chooser.randint(1, 3)))
            answer = "".join(grammar.sentence() for _ in range(chooser.randint(1, 4)))
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        lines.append(json.dumps({"messages": messages}))
    path.write_text("\n".join(lines) + "\n")
    return path


def padding_fraction(layout: Layout, window: int) -> float:
    return 1.0 - float(layout.counts.sum()) / (len(layout) * window)


def epoch(model: Any, stream: TokenStream, layout: Layout, window: int, batch: int, packed: bool) -> tuple[float, int]:
    """Seconds for one epoch over `layout` (after 3 warm-up steps) and the target tokens trained."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = len(layout) // batch
    targets, started = 0, 0.0
    for step in range(steps + 3):
        if step == 3:
            started = time.perf_counter()
        indices = torch.arange((step % steps) * batch, (step % steps + 1) * batch)
        one = build_batch(stream.tokens, stream.flags, layout, indices, window, pad_id=0)
        if packed:
            loss = model(**vars(one), use_cache=False).loss
        else:  # one chat a window: an attention mask over its padding, positions from 0
            mask = (torch.arange(window)[None] < layout.counts[indices][:, None]).long()
            loss = model(input_ids=one.input_ids, labels=one.labels, attention_mask=mask, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 3:
            targets += int((one.labels[:, 1:] != IGNORE).sum())
    return time.perf_counter() - started, targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=800)
    parser.add_argument("--window", type=int, default=256, help="tokens per window (--seq-len + 1)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        tokenizer = HFStreamTokenizer(chat_folder(root / "model"))
        stream = token_stream([write_chats(root / "chats.jsonl", args.chats)], tokenizer)
        starts, ends = document_bounds(stream.flags, 0, stream.tokens.numel())
        lengths = ends - starts
        mean = float(lengths.float().mean())
        print(f"{stream.documents} chats, {int(lengths.min())}-{int(lengths.max())} tokens (mean {mean:.0f})")
        layouts = {
            "packed": packed_windows(starts, ends, args.window, "error", str),
            "unpacked": Layout(starts, lengths),
        }
        config = LlamaConfig(
            vocab_size=tokenizer.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.window,
        )  # fmt: skip
        rates = {}
        for name, layout in layouts.items():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
            model.config._attn_implementation = "sdpa"
            seconds, targets = epoch(model, stream, layout, args.window, args.batch, name == "packed")
            rates[name] = targets / seconds
            padding = 100 * padding_fraction(layout, args.window)
            print(
                f"{name}: {len(layout)} windows of {args.window}, padding {padding:.1f}%, "
                f"{targets / seconds:,.0f} target tokens/s ({seconds:.1f} s for {len(layout) // args.batch} steps)"
            )
        print(f"packed / unpacked target tokens/s: {rates['packed'] / rates['unpacked']:.2f}x")


if __name__ == "__main__":
    main()
