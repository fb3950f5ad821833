"""The tokenizer `--data` is tokenised with: the model folder's own (a transformers tokenizer, batched; a fast one
encodes a batch on its Rust thread pool), or, for the reference GPT, the tiny presets and a folder without a
tokenizer, UTF-8 bytes (ids 0-255, EOS 256: any text, a fixed vocabulary of 257 known before the data is read).

Documents are joined with the EOS id. The fingerprint (the tokenizer files' bytes), the chat template and the rule
that masks a chat's prompt are part of the token cache's key. Chats are rendered with the model folder's chat template
(`_chat_template`); the byte tokenizer has none.
"""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path
from typing import Any, Protocol

import torch

from cx_train.data._chat_records import Conversation, DataError
from cx_train.data._chat_template import chat_rule, chat_tokens

__all__ = ["TOKENIZER_FILES", "ByteTokenizer", "HFStreamTokenizer", "StreamTokenizer", "data_tokenizer"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
)


class StreamTokenizer(Protocol):
    """What the token cache needs: a key for the cache, the EOS id, the special ids and batched encoding."""

    @property
    def fingerprint(self) -> str: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def special_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def chat_template(self) -> str | None: ...

    @property
    def chat_rule(self) -> str: ...

    def encode_batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids of all `texts` end to end (int32) and each text's number of ids (int64)."""
        ...

    def encode_chats(self, chats: list[tuple[Conversation, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ids of all (chat, where it is) end to end (int32), each chat's number of ids (int64) and per id
        whether the loss counts it (uint8: the assistant turns)."""
        ...


def _joined(pieces: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(ids) for ids, _ in pieces], dtype=torch.int64)
    ids = torch.tensor(list(itertools.chain.from_iterable(ids for ids, _ in pieces)), dtype=torch.int32)
    targets = torch.tensor(list(itertools.chain.from_iterable(mask for _, mask in pieces)), dtype=torch.uint8)
    return ids, lengths, targets


def _bytes(text: str | bytes) -> torch.Tensor:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)


class ByteTokenizer:
    """UTF-8 bytes as token ids, EOS = 256. Also a `TextEncoder` (vocab_size, encode)."""

    fingerprint = "utf8-bytes-eos256-v1"
    eos_id = 256
    special_ids = frozenset({256})
    vocab_size = 257
    pad_id = 256
    chat_template: str | None = None
    chat_rule = "no-template"

    def encode(self, text: str) -> torch.Tensor:
        return _bytes(text).to(torch.long)

    def encode_batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = [text.encode("utf-8") for text in texts]
        lengths = torch.tensor([len(raw) for raw in encoded], dtype=torch.int64)
        return _bytes(b"".join(encoded)).to(torch.int32), lengths

    def encode_chats(self, chats: list[tuple[Conversation, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise DataError(f"{chats[0][1]}: {_NO_TEMPLATE} (the built-in models read UTF-8 bytes)")

    def decode(self, ids: torch.Tensor) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


_NO_TEMPLATE = (
    "a chat record, but the tokenizer has no chat template to render it with; use a model folder whose "
    "tokenizer_config.json or chat_template.jinja has one"
)


class HFStreamTokenizer:
    """A model folder's transformers tokenizer; documents are encoded without added special tokens."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self.folder = folder
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        eos = self.tokenizer.eos_token_id
        if not isinstance(eos, int):
            raise ValueError(
                f"--model {folder}: its tokenizer has no EOS token, which --data needs to join documents; "
                "set eos_token in its tokenizer_config.json"
            )
        self._eos = eos
        digest = hashlib.sha256()
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
        self._fingerprint = f"hf-{digest.hexdigest()}"
        pad = self.tokenizer.pad_token_id
        self._pad = pad if isinstance(pad, int) else eos

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(int(i) for i in self.tokenizer.all_special_ids)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    @property
    def chat_rule(self) -> str:
        return chat_rule(self.tokenizer)

    def encode_chats(self, chats: list[tuple[Conversation, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.chat_template is None:
            raise DataError(f"{chats[0][1]}: {_NO_TEMPLATE} (--model {self.folder} has none)")
        return _joined([chat_tokens(self.tokenizer, chat, where) for chat, where in chats])

    @property
    def is_fast(self) -> bool:
        return bool(getattr(self.tokenizer, "is_fast", False))

    def encode_batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            # the Rust tokenizer directly, without offsets: the ids `tokenizer(texts)` gives, 2-3x faster
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            ids = [encoding.ids for encoding in encode(texts, add_special_tokens=False)]
        else:
            ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        lengths = torch.tensor([len(one) for one in ids], dtype=torch.int64)
        return torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.int32), lengths


def data_tokenizer(model: str, is_folder: bool) -> StreamTokenizer:
    """The tokenizer `--data` uses for `--model`: the folder's own when it has one, bytes otherwise."""
    folder = Path(model)
    if is_folder and any((folder / name).is_file() for name in TOKENIZER_FILES[:4]):
        return HFStreamTokenizer(folder)
    return ByteTokenizer()
