"""Chat records in --data: rendered with the model folder's chat template, the loss counting only the assistant turns
(against a hand-built reference, for both ways of finding them), prompt/completion records, the errors that name the
file and line, --overlong, and the token cache keyed on the template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cx_train import parse_options
from cx_train.data._text_sources import DataError
from cx_train.data._token_cache import START, TARGET, cache_key, token_stream
from cx_train.data._tokenizers import HFStreamTokenizer
from cx_train.data._user_data import DataSettings, open_user_data
from train_data_helpers import (
    CHAT_TEMPLATE,
    MARKED_CHAT_TEMPLATE,
    chat_record,
    tiny_chat_llama_folder,
    write_chat_jsonl,
)


def _jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def _reference(folder: Path, records: list[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    """The ids, target flags and document starts written out by hand: each turn is its role's header, the content's
    words and <|end|>; an assistant's words and its <|end|> are targets, nothing else is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids: list[int] = []
    targets: list[int] = []
    starts: list[int] = []
    for record in records:
        starts.append(len(ids))
        for message in record["messages"]:
            body = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            header, end = (
                tokenizer.convert_tokens_to_ids(f"<|{message['role']}|>"),
                tokenizer.convert_tokens_to_ids("<|end|>"),
            )
            assert isinstance(header, int)
            assert isinstance(end, int)
            ids += [header, *body, end]
            targets += [0] + [int(message["role"] == "assistant")] * (len(body) + 1)
    return ids, targets, starts


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, MARKED_CHAT_TEMPLATE], ids=["prefix-renders", "markers"])
def test_train_chat_targets_are_the_assistant_turns(tmp_path: Path, template: str) -> None:
    folder = tiny_chat_llama_folder(tmp_path / "model", template)
    records = [chat_record(1, turns=2), chat_record(2), chat_record(3)]  # with and without a system turn
    stream = token_stream([_jsonl(tmp_path / "chats.jsonl", records)], HFStreamTokenizer(folder))
    ids, targets, starts = _reference(folder, records)
    assert stream.tokens.tolist() == ids  # no EOS between chats: each ends with its template's <|end|>
    assert (stream.flags & TARGET).tolist() == targets
    assert torch.nonzero(stream.flags & START).flatten().tolist() == starts
    assert (stream.documents, stream.chats) == (3, 3)


def test_train_chat_prompt_completion_is_one_user_and_one_assistant_turn(tmp_path: Path) -> None:
    folder = tiny_chat_llama_folder(tmp_path / "model")
    tokenizer = HFStreamTokenizer(folder)
    pairs = [("the cat sees the moon .", "a dog likes an apple ."), ("two dogs see the river !", "my sister paints .")]
    chats = [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]} for p, c in pairs]
    expected = token_stream([_jsonl(tmp_path / "messages.jsonl", chats)], tokenizer)
    plain = token_stream([_jsonl(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])], tokenizer)
    conversational = [{"prompt": chat["messages"][:1], "completion": chat["messages"][1:]} for chat in chats]
    listed = token_stream([_jsonl(tmp_path / "pc_lists.jsonl", conversational)], tokenizer)
    for stream in (plain, listed):
        assert torch.equal(stream.tokens, expected.tokens)
        assert torch.equal(stream.flags, expected.flags)


def test_train_chat_parquet_messages(tmp_path: Path) -> None:
    pyarrow = pytest.importorskip("pyarrow")
    parquet = pytest.importorskip("pyarrow.parquet")
    folder = tiny_chat_llama_folder(tmp_path / "model")
    records = [chat_record(2), chat_record(1, turns=2)]
    parquet.write_table(pyarrow.table({"messages": [r["messages"] for r in records]}), str(tmp_path / "c.parquet"))
    stream = token_stream([tmp_path / "c.parquet"], HFStreamTokenizer(folder))
    ids, targets, _ = _reference(folder, records)
    assert (stream.tokens.tolist(), (stream.flags & TARGET).tolist()) == (ids, targets)


def test_train_chat_errors_name_the_file_and_line(tmp_path: Path) -> None:
    folder = tiny_chat_llama_folder(tmp_path / "model")
    chat = chat_record(2)
    cases: list[tuple[list[dict[str, Any]], str]] = [
        ([chat, {"messages": [{"role": "user", "content": "hi"}]}], r"bad0.jsonl:line 2: the chat has no assistant"),
        ([chat, {"text": "the cat"}], r"bad1.jsonl:line 2: a text record in a file of messages records \(line 1\)"),
        ([{"messages": [{"role": "user"}]}], r'bad2.jsonl:line 1: "messages"\[0\] is not a \{role, content\} message'),
        ([{"prompt": "x", "completion": ["y"]}], r'bad3.jsonl:line 1: "prompt" and "completion" must both be text'),
    ]
    for index, (records, message) in enumerate(cases):
        with pytest.raises(DataError, match=message):
            token_stream([_jsonl(tmp_path / f"bad{index}.jsonl", records)], HFStreamTokenizer(folder))
    bare = tiny_chat_llama_folder(tmp_path / "bare", template=None)
    chats = _jsonl(tmp_path / "chats.jsonl", [chat])
    with pytest.raises(DataError, match=r"chats.jsonl:line 1: a chat record, but the tokenizer has no chat template"):
        token_stream([chats], HFStreamTokenizer(bare))
    with pytest.raises(DataError, match=r"chats.jsonl:line 1: a chat record, but the tokenizer has no chat template"):
        open_user_data(DataSettings((str(chats),)), "gpt", False, 17)  # the built-in models read bytes


def test_train_chat_overlong_records_refused_truncated_or_dropped(tmp_path: Path) -> None:
    folder = tiny_chat_llama_folder(tmp_path / "model")
    long = {"messages": [{"role": "user", "content": "the cat sees the moon . " * 8}, *chat_record(4)["messages"]]}
    records = [chat_record(2), chat_record(4), long, chat_record(6)]
    data = str(_jsonl(tmp_path / "chats.jsonl", records))
    lengths = [len(_reference(folder, [r])[0]) for r in records]
    length = 24
    assert lengths[2] > length >= max(lengths[:2] + lengths[3:]), lengths
    with pytest.raises(DataError, match=rf"chats.jsonl:line 3: {lengths[2]} tokens, longer than the window of 24"):
        open_user_data(DataSettings((data,)), str(folder), True, length)
    truncated = open_user_data(DataSettings((data,), overlong="truncate"), str(folder), True, length)
    assert (truncated.train.layout.truncated, truncated.train.layout.dropped) == (1, 0)
    assert "1 documents truncated, 0 dropped by --overlong" in truncated.summary()
    dropped = open_user_data(DataSettings((data,), overlong="drop"), str(folder), True, length)
    assert (dropped.train.layout.truncated, dropped.train.layout.dropped) == (0, 1)
    long_start = sum(lengths[:2])
    assert long_start not in dropped.train.layout.starts.tolist()
    kept = truncated.train.layout.starts.tolist().index(long_start)  # a window of its own: its first 24 tokens
    window = truncated.train.batch(torch.tensor([kept]))
    assert window.input_ids[0].tolist() == truncated.train.stream.tokens[long_start : long_start + length].tolist()
    assert window.position_ids[0].tolist() == list(range(length))
    assert len(truncated.train) == len(dropped.train) + 1


def test_train_chat_cache_key_follows_the_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tiny_chat_llama_folder(tmp_path / "model")
    data = write_chat_jsonl(tmp_path / "chats.jsonl", 4)
    first = cache_key([data], HFStreamTokenizer(folder), "text")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = MARKED_CHAT_TEMPLATE  # the same ids, another masking rule
    tokenizer.save_pretrained(str(folder))
    second = cache_key([data], HFStreamTokenizer(folder), "text")
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|end|> {% endfor", "<|end|>{% endfor")
    tokenizer.save_pretrained(str(folder))
    third = cache_key([data], HFStreamTokenizer(folder), "text")
    assert len({first, second, third}) == 3


def test_train_chat_and_text_files_together(tmp_path: Path) -> None:
    """A chat file and a text file in one --data: every document is packed whole, the text's every token a target."""
    folder = tiny_chat_llama_folder(tmp_path / "model")
    chats = write_chat_jsonl(tmp_path / "chats.jsonl", 3)
    text = _jsonl(tmp_path / "text.jsonl", [{"text": "the cat sees the moon ."}])
    user = open_user_data(DataSettings((str(chats), str(text))), str(folder), True, 64)
    stream = user.train.stream
    assert (stream.documents, stream.chats) == (4, 3)
    tail = stream.flags[-7:]  # the text's 6 words and its EOS
    assert (tail & TARGET).tolist() == [1] * 7
    assert (tail & START).tolist() == [START] + [0] * 6


def test_train_chat_overlong_flag_reaches_the_data_and_refuses_before_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tiny_chat_llama_folder(tmp_path / "model")
    long = {"messages": [{"role": "user", "content": "the cat sees the moon . " * 12}, *chat_record(4)["messages"]]}
    data = str(_jsonl(tmp_path / "chats.jsonl", [chat_record(2), chat_record(4), long, chat_record(6)]))
    flags = ["--model", str(folder), "--data", data, "--seq-len", "31", "--batch-size", "1"]
    with pytest.raises(SystemExit) as caught:
        parse_options(flags, world_size=1)
    assert caught.value.code == 2
    assert "chats.jsonl:line 3: " in capsys.readouterr().err
    options = parse_options([*flags, "--overlong", "drop"], world_size=1)
    assert options.data is not None
    assert options.data.overlong == "drop"
