"""Document-aware packing: position ids restart at each document, a document's first token and the padding are
never targets, and the loss of a packed batch through a transformers Llama (its packed-sequence mask from the
position ids) equals the documents' losses computed one at a time; so does cx's reference GPT's, given the position
ids by cx-train's forward step; the evaluation's token mean likewise."""

from __future__ import annotations

import json
import math
from pathlib import Path
from unittest.mock import patch

import pytest
import torch

import cx_train.data._packing as packing
from cx_mesh.testing import run_distributed, sum_tolerance
from cx_train import GrammarText, parse_options
from cx_train.data._packing import IGNORE, build_batch, document_bounds, fixed_windows, packed_windows
from cx_train.data._token_cache import START, TARGET, TokenStream
from cx_train.data._user_data import UserData, open_user_data
from cx_train.metrics._progress import forward_step
from cx_train.models._spec import build_model, describe_model
from cx_train.step._evaluation import evaluate
from train_data_helpers import tiny_chat_llama_folder, write_chat_jsonl


def _flags(lengths: list[int], prompts: list[int]) -> torch.Tensor:
    """Flags of documents of `lengths` whose first `prompts` tokens are not targets."""
    flags: list[int] = []
    for length, prompt in zip(lengths, prompts, strict=True):
        flags += [START | (TARGET if prompt == 0 else 0)] + [0 if i < prompt else TARGET for i in range(1, length)]
    return torch.tensor(flags, dtype=torch.uint8)


def test_train_packing_restarts_positions_and_ignores_boundaries_and_padding() -> None:
    tokens = torch.tensor([10, 11, 12, 20, 21, 30, 31, 32, 33], dtype=torch.int32)
    flags = _flags([3, 2, 4], [0, 1, 2])  # the second and third documents begin with 1 and 2 prompt tokens
    starts, ends = document_bounds(flags, 0, 9)
    assert (starts.tolist(), ends.tolist()) == ([0, 3, 5], [3, 5, 9])
    with patch.object(packing, "_BLOCK", 2):  # scanned in blocks: the same documents
        assert [t.tolist() for t in document_bounds(flags, 1, 9)] == [[1, 3, 5], [3, 5, 9]]
    layout = packed_windows(starts, ends, 6, "error", str)
    assert (layout.starts.tolist(), layout.counts.tolist()) == ([0, 5], [5, 4])  # greedy, in order
    batch = build_batch(tokens, flags, layout, torch.arange(2), 6, pad_id=0)
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, 21, 0], [30, 31, 32, 33, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]  # the padding: its own segment
    assert batch.labels.tolist() == [[-100, 11, 12, -100, 21, -100], [-100, -100, 32, 33, -100, -100]]
    assert batch.targets() == 5
    # plain text cut at the window: a window starting inside a document restarts its positions there
    text = build_batch(tokens, _flags([3, 6], [0, 0]), fixed_windows(0, 2, 4), torch.arange(2), 4, pad_id=0)
    assert text.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 2, 3]]
    assert text.input_ids.tolist() == [[10, 11, 12, 20], [21, 30, 31, 32]]
    assert text.labels.tolist() == [[-100, 11, 12, -100], [-100, 30, 31, 32]]


def test_train_packing_splits_a_long_evaluation_document_with_one_token_of_overlap() -> None:
    starts, ends = torch.tensor([0, 11]), torch.tensor([11, 13])
    layout = packed_windows(starts, ends, 4, "split", str)
    assert (layout.starts.tolist(), layout.counts.tolist(), layout.split) == ([0, 3, 6, 9], [4, 4, 4, 4], 1)
    flags = _flags([11, 2], [0, 0])
    batch = build_batch(torch.arange(13, dtype=torch.int32), flags, layout, torch.arange(4), 4, pad_id=0)
    targets = batch.labels[batch.labels != IGNORE].tolist()
    assert targets == [*range(1, 11), 12]  # every token of a document but its first, once


def _llama(folder: Path, attention: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation=attention, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights far from the initialisation's near-uniform predictions: attention matters
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    model.eval()
    return model


def _per_document(model: torch.nn.Module, stream: TokenStream) -> tuple[float, int]:
    """The sum of the token losses and the number of targets, each document alone through transformers."""
    starts, ends = document_bounds(stream.flags, 0, stream.tokens.numel())
    total, count = 0.0, 0
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        ids = stream.tokens[start:end].long()[None]
        labels = torch.where((stream.flags[start:end] & TARGET) != 0, ids[0], IGNORE)[None]
        n = int((labels[:, 1:] != IGNORE).sum())
        with torch.no_grad():
            total += float(model(input_ids=ids, labels=labels, use_cache=False).loss) * n
        count += n
    return total, count


def _write_text_jsonl(path: Path, documents: int) -> Path:
    grammar = GrammarText(5)
    lines = (json.dumps({"text": " ".join(grammar.sentence() for _ in range(1 + i % 3))}) for i in range(documents))
    path.write_text("\n".join(lines) + "\n")
    return path


def _data(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    folder = tiny_chat_llama_folder(tmp_path / "model")
    if kind == "chat":
        return folder, write_chat_jsonl(tmp_path / "data.jsonl", 12)
    return folder, _write_text_jsonl(tmp_path / "data.jsonl", 12)


def _options(folder: Path, data: Path) -> list[str]:
    data_flags = ["--data", str(data), "--eval-data", str(data)]
    return ["--model", str(folder), *data_flags, "--batch-size", "1", "--seq-len", "63"]


def _tolerance(targets: int, loss: float) -> float:
    """The packed and per-document losses are the same sums of the same token losses in another order; each token's
    loss goes through the same float32 arithmetic on rows of another length (the attention's softmax sums over
    the document's keys either way: the keys masked out add exact zeros), so the per-token values agree to a few
    ulps and the two means to the rounding of a float32 sum of `targets` terms of that size (sum_tolerance)."""
    return sum_tolerance(n_terms=targets, magnitude=targets * loss) / targets + 4 * loss * torch.finfo().eps


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["chat", "text"])
def test_train_packed_loss_equals_the_documents_one_at_a_time(tmp_path: Path, kind: str, attention: str) -> None:
    folder, data = _data(tmp_path, kind)
    options = parse_options(_options(folder, data), world_size=1)
    assert options.data is not None
    user = open_user_data(options.data, str(folder), True, 64)
    windows = user.evaluation  # packed whole (text too)
    assert windows is not None
    assert len(windows) < windows.stream.documents  # several documents share a window
    model = _llama(folder, attention)
    batch = windows.batch(torch.arange(len(windows)))
    with torch.no_grad():
        # use_cache=False as cx-train's forward passes it: with a cache transformers skips the packed-sequence mask
        packed = float(model(**vars(batch), use_cache=False).loss)
    total, count = _per_document(model, windows.stream)
    assert batch.targets() == count
    assert abs(packed - total / count) <= _tolerance(count, total / count), (packed, total / count)
    # what cross-contamination would cost: the same windows with the cache transformers makes by default (or
    # without position ids) attend across documents
    with torch.no_grad():
        crossed = float(model(**vars(batch)).loss)
    assert abs(crossed - total / count) > 10 * _tolerance(count, total / count)


def test_train_packed_gpt_loss_equals_the_documents_one_at_a_time(tmp_path: Path) -> None:
    """cx's reference GPT (`--model gpt`, byte tokens) through cx-train's `forward_step`: the packed windows' loss is
    the documents' one at a time (positions restart and attention stops at each document)."""
    data = tmp_path / "data.jsonl"  # documents of 10 to 24 bytes (+ EOS): whole in a window of 64
    data.write_text("".join(json.dumps({"text": "the cat sees the moon . "[: 10 + 3 * i]}) + "\n" for i in range(11)))
    options = parse_options(
        ["--model", "gpt", "--data", str(data), "--eval-data", str(data), "--seq-len", "63", "--batch-size", "1"],
        world_size=1,
    )
    assert options.data is not None
    described = describe_model(options.model_spec)
    windows = open_user_data(options.data, "gpt", False, 64).evaluation  # packed whole
    assert windows is not None
    assert len(windows) < windows.stream.documents  # several documents share a window
    model = build_model(described, seed=0)
    batch = windows.batch(torch.arange(len(windows)))
    with torch.no_grad():
        packed = forward_step(model, batch, described).loss
        assert packed is not None
        starts, ends = document_bounds(windows.stream.flags, 0, windows.stream.tokens.numel())
        total, count = 0.0, 0
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            ids = windows.stream.tokens[start:end].long()[None]
            total += float(model(ids, labels=ids)) * (end - start - 1)
            count += end - start - 1
        crossed = float(model(batch.input_ids, labels=batch.labels))  # no position ids: documents attend across
    assert batch.targets() == count
    assert abs(float(packed) - total / count) <= _tolerance(count, total / count), (float(packed), total / count)
    assert abs(crossed - total / count) > 10 * _tolerance(count, total / count)


def _evaluate(rank: int, world_size: int, folder: str, data: str, expected: float, count: int) -> None:
    options = parse_options(_options(Path(folder), Path(data)), world_size=world_size)
    assert options.data is not None
    user: UserData = open_user_data(options.data, folder, True, 64)
    assert user.evaluation is not None
    model = _llama(Path(folder), "sdpa")
    result = evaluate(model, user, describe_model(options.model_spec), 2, (rank, world_size), torch.device("cpu"), 3)
    assert abs(result.loss - expected) <= _tolerance(count, expected), (result.loss, expected)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)


def test_train_evaluation_is_the_token_mean_of_the_documents(tmp_path: Path) -> None:
    """Two ranks x batch 2 over windows that do not fill the last global batch: the token mean of the set equals the
    documents' losses computed one at a time, the last partial window included, every document once (text is packed
    for evaluation by the same code: the test above)."""
    folder, data = _data(tmp_path, "chat")
    options = parse_options(_options(folder, data), world_size=2)
    assert options.data is not None
    user = open_user_data(options.data, str(folder), True, 64)
    assert user.evaluation is not None
    assert len(user.evaluation) % 4 != 0
    total, count = _per_document(_llama(folder, "sdpa"), user.evaluation.stream)
    run_distributed(_evaluate, 2, folder=str(folder), data=str(data), expected=total / count, count=count)
