"""cx-train --data: tokenisation throughput and the loader's cost per training step, as ratios.

1. Tokenising a JSON Lines corpus into the token cache (reading the file, encoding in batches, checking every
   document, writing the int32 stream) against a plain loop of `tokenizer(batch)` over the same texts already in
   memory (no reading, no writing): tokens/s of each and their ratio, for a fast (Rust) word-level tokenizer built
   locally and for the UTF-8 byte tokenizer of the built-in models. Also: opening the cache again / tokenising.
2. The loader's time to produce one rank's batch (the window order, the memory-mapped windows, the int64 copy)
   against one training step of the demo's default GPT (forward, backward, AdamW) on the same batch, one process.

Run: OMP_NUM_THREADS=1 python benchmarks/data/bench_data.py [--mb 20] [--steps 30] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cx_train import GrammarText, parse_options
from cx_train.data._token_cache import token_stream
from cx_train.data._tokenizers import ByteTokenizer, HFStreamTokenizer, StreamTokenizer
from cx_train.data._user_data import open_user_data
from cx_train.data._user_loader import UserLoader
from cx_train.models._spec import build_model, describe_model


def tokenizer_folder(folder: Path) -> Path:
    """A word-level fast tokenizer (EOS `</s>`) over the grammar's words, built locally and saved as a folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = GrammarText(0).generate(20000)
    words = sorted(set(text.replace(".", " . ").replace("!", " ! ").replace("?", " ? ").split()))
    vocab = {"[UNK]": 0, "</s>": 1, **{word: i + 2 for i, word in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="</s>").save_pretrained(str(folder))
    return folder


def write_corpus(path: Path, megabytes: float) -> list[str]:
    grammar = GrammarText(0)
    texts = [grammar.generate(1000) for _ in range(int(megabytes * 1000))]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


def plain_loop(tokenizer: HFStreamTokenizer, texts: list[str], batch: int = 1000) -> tuple[int, float]:
    """The baseline: `tokenizer(batch)` over texts already in memory, nothing read, checked or written."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        tokens += sum(
            len(ids) for ids in tokenizer.tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"]
        )
    return tokens, time.perf_counter() - start


def build(corpus: Path, tokenizer: StreamTokenizer, workers: int) -> tuple[float, float]:
    """(tokens/s of building the cache from the file, seconds of opening it again)."""
    for stale in corpus.parent.glob(".cx-token-cache/*"):
        stale.unlink()
    start = time.perf_counter()
    stream = token_stream([corpus], tokenizer, workers=workers)
    build_s = time.perf_counter() - start
    start = time.perf_counter()
    again = token_stream([corpus], tokenizer, workers=workers)
    open_s = time.perf_counter() - start
    assert again.reused
    assert not stream.reused
    return stream.tokens.numel() / build_s, open_s / build_s


def tokenisation(folder: Path, corpus: Path, texts: list[str], workers: int, repeats: int) -> None:
    """Paired runs (plain loop, then cx with 1 and with `workers` processes), repeated: the median of the paired
    ratios, so that the load of a shared machine hits both sides of each ratio alike."""
    fast = HFStreamTokenizer(folder)
    counts = sorted({1, workers})
    ratios: dict[int, list[float]] = {count: [] for count in counts}
    rates: dict[int, list[float]] = {0: [], **{count: [] for count in counts}}
    reopen: list[float] = []
    for _ in range(repeats):
        plain_tokens, plain_s = plain_loop(fast, texts)
        rates[0].append(plain_tokens / plain_s)
        for count in counts:
            rate, reopened = build(corpus, fast, count)
            rates[count].append(rate)
            ratios[count].append(rate / rates[0][-1])
            reopen.append(reopened)
    plain = statistics.median(rates[0])
    print(f"fast word-level: plain tokenizer(batch) loop {plain / 1e6:.3f} Mtok/s (median of {repeats})")
    for count in counts:
        print(
            f"  cx cache build, {count} worker(s): {statistics.median(rates[count]) / 1e6:.3f} Mtok/s, "
            f"/ plain (median of paired ratios) {statistics.median(ratios[count]):.2f} "
            f"{[round(r, 2) for r in ratios[count]]}"
        )
    print(f"  reopening the cache / building it: {statistics.median(reopen):.5f}")
    rate, reopened = build(corpus, ByteTokenizer(), 1)
    print(f"utf-8 bytes: cx cache build {rate / 1e6:.2f} Mtok/s; reopening / building {reopened:.5f}")


def loader_cost(corpus: Path, steps: int) -> None:
    options = parse_options(["--data", str(corpus), "--nproc", "1", "--plugin", "torch_ddp"], world_size=1)
    described = describe_model(options.model_spec)
    assert options.data is not None
    data = open_user_data(options.data, options.model, False, options.window_length)
    loader = UserLoader(data, options, (0, 1))
    model = build_model(described, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = iter(loader)
    load, step = [], []
    for _ in range(steps):
        start = time.perf_counter()
        batch = next(batches)
        load.append(time.perf_counter() - start)
        start = time.perf_counter()
        model(batch.input_ids, labels=batch.labels).backward()
        optimizer.step()
        optimizer.zero_grad()
        step.append(time.perf_counter() - start)
    load_ms, step_ms = statistics.median(load) * 1e3, statistics.median(step) * 1e3
    print(
        f"loader {load_ms:.3f} ms / step {step_ms:.1f} ms (GPT hidden 128, 2 layers, batch 8 x 65, 1 process): "
        f"{100 * load_ms / step_ms:.2f}% of the step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="corpus size in MB of text")
    parser.add_argument("--steps", type=int, default=30, help="training steps timed for the loader's share")
    parser.add_argument("--repeats", type=int, default=3, help="paired tokenisation runs")
    parser.add_argument("--workers", type=int, default=2, help="tokenising processes (also timed: 1)")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as root:
        folder = tokenizer_folder(Path(root) / "tokenizer")
        corpus = Path(root) / "data" / "corpus.jsonl"
        corpus.parent.mkdir()
        texts = write_corpus(corpus, args.mb)
        tokenisation(folder, corpus, texts, args.workers, args.repeats)
        loader_cost(corpus, args.steps)


if __name__ == "__main__":
    main()
