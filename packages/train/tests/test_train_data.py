"""cx-train --data: formats, the token cache, the world-size independent order, bad-data errors (each naming the file
and line or row) and evaluation; the training runs are in test_train_data_training.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cx_train import parse_options
from cx_train.data._order import DataPosition, WindowOrder
from cx_train.data._text_sources import DataError, resolve_data_paths
from cx_train.data._token_cache import CACHE_FOLDER, token_stream
from cx_train.data._tokenizers import ByteTokenizer, HFStreamTokenizer, data_tokenizer
from cx_train.data._user_data import DataSettings, open_user_data
from train_data_helpers import tiny_llama_folder, write_jsonl, write_text


def _stream(paths: list[Path], **kwargs: object) -> list[int]:
    return token_stream(paths, ByteTokenizer(), **kwargs).tokens.tolist()  # type: ignore[arg-type]


def test_train_data_text_and_jsonl_documents_are_joined_with_eos(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("ab\ncd\n")
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n\n{"text": "yz", "id": 3}\n')
    (tmp_path / "c.jsonl").write_text('{"body": "q"}\n')
    paths = resolve_data_paths([str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl")])
    eos = ByteTokenizer.eos_id
    assert _stream(paths) == [*b"ab\ncd\n", eos, *b"x", eos, *b"yz", eos]
    assert token_stream([tmp_path / "c.jsonl"], ByteTokenizer(), "body").tokens.tolist() == [*b"q", eos]


def test_train_data_cache_is_reused_and_keyed_by_the_files(tmp_path: Path) -> None:
    data = write_text(tmp_path / "corpus.txt", 3000)
    first = token_stream([data], ByteTokenizer())
    assert not first.reused
    assert first.path.parent == tmp_path / CACHE_FOLDER
    written = first.path.stat().st_mtime_ns
    second = token_stream([data], ByteTokenizer())
    assert second.reused
    assert second.path == first.path
    assert second.path.stat().st_mtime_ns == written  # not rewritten
    assert torch.equal(first.tokens, second.tokens)
    os.utime(data, ns=(written + 10**9, written + 10**9))  # the same bytes, touched: tokenised again
    third = token_stream([data], ByteTokenizer())
    assert not third.reused
    assert third.path != first.path
    assert not token_stream([data], ByteTokenizer(), "other_field").reused  # the settings are part of the key


def test_train_data_cache_with_ids_outside_the_vocabulary_is_named(tmp_path: Path) -> None:
    """A damaged cache (or one not written for this tokenizer) is refused on open, naming the file, instead of
    torch's `IndexError: index out of range in self` from the embedding at the first step."""
    data = write_text(tmp_path / "corpus.txt", 300)
    stream = token_stream([data], ByteTokenizer())
    with stream.path.open("r+b") as file:
        file.seek(8)
        file.write((5000).to_bytes(4, sys.byteorder))
    with pytest.raises(
        DataError, match=r"\.tokens: the token cache holds ids \d+\.\.5000, outside the tokenizer's 257"
    ):
        token_stream([data], ByteTokenizer())


def test_train_data_cache_goes_to_the_cache_dir_when_the_data_folder_is_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_text(tmp_path / "corpus.txt", 500)
    monkeypatch.setattr("cx_train.data._token_cache.os.access", lambda path, mode: False)
    stream = token_stream([data], ByteTokenizer(), cache_root=tmp_path / "cache")
    assert stream.path.parent == tmp_path / "cache"


def test_train_data_workers_give_the_same_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cx_train.data._token_cache._BATCH_CHARS", 500)  # several batches
    data = write_jsonl(tmp_path / "docs.jsonl", 40)
    one = token_stream([data], ByteTokenizer(), cache_root=None, workers=1).tokens.clone()
    (tmp_path / CACHE_FOLDER).rename(tmp_path / "old")
    two = token_stream([data], ByteTokenizer(), workers=2)
    assert not two.reused
    assert torch.equal(one, two.tokens)


def test_train_data_hf_tokenizer_stream(tmp_path: Path) -> None:
    folder = tiny_llama_folder(tmp_path / "llama")
    data = write_jsonl(tmp_path / "docs.jsonl", 3)
    tokenizer = data_tokenizer(str(folder), is_folder=True)
    assert isinstance(tokenizer, HFStreamTokenizer)
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()]
    expected: list[int] = []
    for text in texts:  # one at a time through transformers: the batched Rust encoding gives the same ids
        expected += [*tokenizer.tokenizer(text, add_special_tokens=False)["input_ids"], tokenizer.eos_id]
    assert token_stream([data], tokenizer).tokens.tolist() == expected
    assert tokenizer.eos_id == 1


def test_train_data_order_is_independent_of_the_data_parallel_size() -> None:
    """A global batch of 8 windows split over 1, 2 or 4 ranks: the same windows per step, and the same windows after
    resuming from a position; each epoch visits every window at most once."""
    orders = {dp: WindowOrder(50, 8, seed=3) for dp in (1, 2, 4)}
    position = {dp: DataPosition() for dp in orders}
    seen: list[int] = []
    for _ in range(8):  # 6 steps per epoch: crosses into epoch 1
        taken = {}
        for dp, order in orders.items():
            indices, position[dp] = order.take(position[dp])
            taken[dp] = torch.cat([WindowOrder.rank_slice(indices, r, dp) for r in range(dp)]).tolist()
        assert taken[1] == taken[2] == taken[4]
        seen += taken[1]
    assert len(set(seen[:48])) == 48
    assert position[1] == DataPosition(1, 16)
    assert orders[1].position_at(8) == DataPosition(1, 16)
    resumed = WindowOrder(50, 8, seed=3)
    assert resumed.take(DataPosition(1, 8))[0].tolist() == seen[-8:]
    assert WindowOrder(50, 8, seed=4).take(DataPosition())[0].tolist() != seen[:8]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.txt", "", "empty.txt: the file is empty"),
        ("blank.txt", "\n  \n", "blank.txt: the file holds only whitespace"),
        ("nul.txt", "\x00" * 64, "nul.txt: holds NUL bytes (a preallocated or crashed file), not text"),
        ("empty.jsonl", "\n\n", "empty.jsonl: the file holds no JSON lines"),
        ("field.jsonl", '{"text": "ok"}\n{"body": "no"}\n', 'field.jsonl:line 2: no "text" field (it has: body)'),
        ("bad.jsonl", '{"text": "ok"}\n\n{"text": \n', "bad.jsonl:line 3: not a JSON object"),
        ("type.jsonl", '{"text": 5}\n', 'type.jsonl:line 1: the "text" value is int, not text'),
        ("nothing.jsonl", '{"text": "a"}\n{"text": ""}\n', "nothing.jsonl:line 2: the document is empty or only"),
    ],
)
def test_train_data_bad_data_names_file_and_line(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        token_stream([tmp_path / name], ByteTokenizer())


def test_train_data_document_of_only_special_tokens(tmp_path: Path) -> None:
    tokenizer = data_tokenizer(str(tiny_llama_folder(tmp_path / "llama")), is_folder=True)
    data = tmp_path / "special.jsonl"
    data.write_text('{"text": "the cat sees the moon"}\n{"text": "</s> </s>"}\n')
    with pytest.raises(DataError, match=r"special.jsonl:line 2: the document is empty or only special tokens"):
        token_stream([data], tokenizer)


def test_train_data_missing_paths_and_short_corpus(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--data .*nothing\*\.txt: the pattern matches no file"):
        resolve_data_paths([str(tmp_path / "nothing*.txt")])
    with pytest.raises(DataError, match=r"--data .*missing.txt: no such file"):
        resolve_data_paths([str(tmp_path / "missing.txt")])
    (tmp_path / "folder").mkdir()
    with pytest.raises(DataError, match=r"not one written by datasets\.Dataset\.save_to_disk"):
        resolve_data_paths([str(tmp_path / "folder")])
    with pytest.raises(DataError, match=r"--data /dev/zero: not a regular file \(a device, pipe or socket\)"):
        resolve_data_paths(["/dev/zero"])
    (tmp_path / "folder" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(DataError, match=r"a datasets\.DatasetDict folder \(splits: train, test\); pass one split's"):
        resolve_data_paths([str(tmp_path / "folder")])
    short = tmp_path / "short.txt"
    short.write_text("abc")  # 3 bytes + EOS: shorter than a window of 17
    with pytest.raises(DataError, match=r"short.txt: 4 tokens, shorter than one window of 17"):
        open_user_data(DataSettings((str(short),)), "gpt", False, 17)


def test_train_data_parquet(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    parquet.write_table(pyarrow.table({"text": ["ab", "c"], "n": [1, 2]}), str(tmp_path / "a.parquet"))
    assert _stream([tmp_path / "a.parquet"]) == [*b"ab", 256, *b"c", 256]
    parquet.write_table(pyarrow.table({"body": ["ab"]}), str(tmp_path / "b.parquet"))
    with pytest.raises(DataError, match=r'b.parquet: no "text" column \(it has: body\)'):
        token_stream([tmp_path / "b.parquet"], ByteTokenizer())
    parquet.write_table(pyarrow.table({"text": ["ab", None]}), str(tmp_path / "c.parquet"))
    with pytest.raises(DataError, match=r'c.parquet: row 1: the "text" value is NoneType'):
        token_stream([tmp_path / "c.parquet"], ByteTokenizer())


def test_train_data_saved_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["ab", "c"]}).save_to_disk(str(tmp_path / "saved"))
    paths = resolve_data_paths([str(tmp_path / "saved")])
    assert _stream(paths) == [*b"ab", 256, *b"c", 256]
    datasets.Dataset.from_dict({"body": ["ab"]}).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(DataError, match=r'other: no "text" column \(it has: body\)'):
        token_stream(resolve_data_paths([str(tmp_path / "other")]), ByteTokenizer())


def test_train_data_eval_fraction_holds_out_the_last_windows(tmp_path: Path) -> None:
    data = write_text(tmp_path / "corpus.txt", 16 * 20 - 1)  # + EOS: exactly 20 windows of 16
    user = open_user_data(DataSettings((str(data),), eval_fraction=0.1), "gpt", False, 16)
    assert len(user.train) == 18
    assert user.evaluation is not None
    # the held-out 32 tokens packed whole, split into windows that overlap by one token (the last one partial):
    # [288, 304), [303, 319), [318, 320) + padding; every held-out token but the first is a target exactly once
    assert len(user.evaluation) == 3
    whole = user.train.stream.tokens.long()
    batch = user.evaluation.batch(torch.arange(3))
    assert torch.equal(batch.input_ids[1], whole[303:319])
    assert torch.equal(batch.input_ids[2, :2], whole[318:])
    assert torch.equal(batch.labels[:, 1:][batch.labels[:, 1:] != -100], whole[289:])
    assert batch.position_ids[2].tolist() == [0, 1, *range(14)]  # the padding is a segment of its own


def test_train_data_refused_before_any_process_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_text(tmp_path / "corpus.txt", 16 * 20 - 1)  # 20 windows of 16 tokens
    (tmp_path / "field.jsonl").write_text('{"body": "x"}\n')
    for argv, message in [
        (["--data", str(data), "--seq-len", "15", "--batch-size", "11"], "20 training windows of 16 tokens, fewer "
         "than one global batch of 22"),
        (["--data", str(tmp_path / "field.jsonl")], 'field.jsonl:line 1: no "text" field'),
        (["--eval-every", "5"], "--eval-data, --eval-fraction and --eval-every need --data"),
        (["--data", str(data), "--eval-every", "5"], "--eval-every needs --eval-data FILE or --eval-fraction F"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as caught:
            parse_options(argv, world_size=2)
        assert caught.value.code == 2
        assert message in capsys.readouterr().err


def _open_together(data: str, start: Any, reused: Any) -> None:
    start.wait()
    reused.put(token_stream([Path(data)], ByteTokenizer()).reused)


def test_train_data_processes_starting_together_tokenise_once(tmp_path: Path) -> None:
    """Ranks under an outside torchrun open the cache at the same moment: one tokenises, the others reuse its cache."""
    data = write_jsonl(tmp_path / "docs.jsonl", 3000)
    context = multiprocessing.get_context("spawn")
    start, reused = context.Barrier(3), context.Queue()
    processes = [context.Process(target=_open_together, args=(str(data), start, reused)) for _ in range(3)]
    for process in processes:
        process.start()
    results = sorted(reused.get(timeout=120) for _ in processes)
    for process in processes:
        process.join(timeout=60)
    assert results == [False, True, True]
    assert len(list((tmp_path / CACHE_FOLDER).glob("*.tokens"))) == 1
