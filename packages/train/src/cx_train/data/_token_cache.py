"""Tokenise `--data` once: the documents' token ids, each text document followed by the tokenizer's EOS (a chat
ends with its template's own end of turn), in one flat int32 file that later runs memory-map (`torch.from_file`,
copy-on-write pages read on demand, so a corpus larger than memory trains and a second start does not tokenise
again); beside it one uint8 of flags per token: `TARGET` (the loss counts it: every token of a text, the assistant
turns of a chat) and `START` (a document begins here), which packing turns into labels and position ids.

The cache sits beside the data, in `.cx-token-cache/` of the first file's folder, or under `cache_root` when that
folder is not writable. Its name is a hash of every data file's path, size and modification time, the tokenizer's
fingerprint, its chat template and masking rule and the settings that change the ids (the text field, the format
version): any change makes a new file.
`<key>.tokens` and `<key>.flags` are written under temporary names and renamed, then `<key>.json` (its description)
last, so a cache
whose description exists is complete; processes opening the same cache at once (the ranks under an outside torchrun)
take turns on `<key>.lock` (`flock`), so one tokenises and the others find its cache.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, BinaryIO

import torch

from cx_train._launcher_watch import exit_with_parent
from cx_train.data._chat_records import Conversation
from cx_train.data._text_sources import DataError, Document, iter_documents
from cx_train.data._tokenizers import StreamTokenizer

__all__ = ["CACHE_FOLDER", "START", "TARGET", "TokenStream", "cache_key", "default_cache_root", "token_stream"]

CACHE_FOLDER = ".cx-token-cache"
TARGET, START = 1, 2  # the bits of a token's flags
_VERSION = 2
_BATCH_CHARS = 4 << 20  # documents are encoded in batches of about this many characters


@dataclass(frozen=True)
class TokenStream:
    """The memory-mapped token ids (int32) of a corpus and their flags (uint8, `TARGET` | `START`), whether any
    document is a chat (then documents are packed whole), and whether this call found them already cached."""

    path: Path
    tokens: torch.Tensor
    documents: int
    reused: bool
    sources: tuple[Path, ...]
    flags: torch.Tensor
    chats: int = 0


def default_cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cx" / "tokens"


def cache_key(paths: Sequence[Path], tokenizer: StreamTokenizer, text_field: str) -> str:
    template = hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()
    settings = [_VERSION, tokenizer.fingerprint, text_field, template, tokenizer.chat_rule]
    digest = hashlib.sha256(json.dumps(settings).encode())
    for path in paths:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            stat = file.stat()
            digest.update(f"{file}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _cache_folder(paths: Sequence[Path], cache_root: Path | None) -> Path:
    beside = paths[0].parent / CACHE_FOLDER
    try:
        beside.mkdir(exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass  # a read-only data folder
    root = cache_root or default_cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def token_stream(
    paths: Sequence[Path],
    tokenizer: StreamTokenizer,
    text_field: str = "text",
    cache_root: Path | None = None,
    workers: int = 1,
) -> TokenStream:
    """The token stream of `paths`, from the cache when present, else tokenised (in `workers` processes) and cached."""
    key = cache_key(paths, tokenizer, text_field)
    folder = _cache_folder(paths, cache_root)
    tokens_path, description_path = folder / f"{key}.tokens", folder / f"{key}.json"
    flags_path = folder / f"{key}.flags"
    with (folder / f"{key}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together: one tokenises, the others wait and reuse it
        description = _complete(tokens_path, flags_path, description_path)
        reused = description is not None
        if description is None:
            description = _build(paths, tokenizer, text_field, tokens_path, flags_path, workers)
            temporary = description_path.with_name(f".{description_path.name}.{os.getpid()}")
            temporary.write_text(json.dumps(description, indent=1))
            os.replace(temporary, description_path)
    count = int(description["tokens"])
    ids = torch.from_file(str(tokens_path), shared=False, size=count, dtype=torch.int32)
    flags = torch.from_file(str(flags_path), shared=False, size=count, dtype=torch.uint8)
    _check_range(ids, tokenizer.vocab_size, tokens_path)
    documents, chats = int(description["documents"]), int(description["chats"])
    return TokenStream(tokens_path, ids, documents, reused, tuple(paths), flags, chats)


def _check_range(ids: torch.Tensor, vocab_size: int, tokens_path: Path) -> None:
    """Every id within the tokenizer's vocabulary (one pass over the mapped file, at memory speed): an id past it
    would fail deep in the embedding as torch's `IndexError: index out of range in self`."""
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise DataError(
            f"{tokens_path}: the token cache holds ids {low}..{high}, outside the tokenizer's {vocab_size} ids; it "
            "was not written for this tokenizer or is damaged: delete it and the run tokenises the data again"
        )


def _complete(tokens_path: Path, flags_path: Path, description_path: Path) -> dict[str, Any] | None:
    """The description of a complete cache (its stream as long as it says, in this machine's byte order), or None."""
    if not (description_path.is_file() and tokens_path.is_file() and flags_path.is_file()):
        return None
    description: dict[str, Any] = json.loads(description_path.read_text())
    if tokens_path.stat().st_size != 4 * description["tokens"] or description["byteorder"] != sys.byteorder:
        return None
    return description if flags_path.stat().st_size == description["tokens"] else None


def _batches(paths: Sequence[Path], text_field: str) -> Iterator[list[Document]]:
    batch: list[Document] = []
    size = 0
    for path in paths:
        for document in iter_documents(path, text_field):
            batch.append(document)
            size += len(document[0]) if isinstance(document[0], str) else sum(len(c) for _, c in document[0].turns)
            if size >= _BATCH_CHARS:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


Encoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (ids end to end, ids per document, TARGET per id)


def _encode(tokenizer: StreamTokenizer, batch: list[Document]) -> Encoded:
    """A batch's ids, lengths and targets: runs of texts through `encode_batch`, runs of chats through
    `encode_chats` (a batch may span a text file and a chat file)."""
    parts: list[Encoded] = []
    start = 0
    while start < len(batch):
        chat = isinstance(batch[start][0], Conversation)
        stop = start
        while stop < len(batch) and isinstance(batch[stop][0], Conversation) == chat:
            stop += 1
        run = batch[start:stop]
        if chat:
            parts.append(tokenizer.encode_chats([(c, where) for c, where, _ in run if isinstance(c, Conversation)]))
        else:
            ids, lengths = tokenizer.encode_batch([text for text, _, _ in run if isinstance(text, str)])
            parts.append((ids, lengths, torch.full_like(ids, TARGET, dtype=torch.uint8)))
        start = stop
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def _encoded(
    paths: Sequence[Path], tokenizer: StreamTokenizer, text_field: str, workers: int
) -> Iterator[tuple[list[Document], Encoded]]:
    """(batch, its ids) in order; with several workers, up to 2 x workers batches are encoded at once."""
    if workers <= 1:
        for batch in _batches(paths, text_field):
            yield batch, _encode(tokenizer, batch)
        return
    # a forked worker shares the cache lock's file: it must not outlive its parent (exit_with_parent)
    with ProcessPoolExecutor(
        max_workers=workers,
        mp_context=get_context("fork"),
        initializer=exit_with_parent,
        initargs=("tokenising", os.getpid()),  # this process: a worker may start only after it died
    ) as pool:
        pending: list[tuple[list[Document], Future[Encoded]]] = []
        for batch in _batches(paths, text_field):
            pending.append((batch, pool.submit(_encode, tokenizer, batch)))
            if len(pending) >= 2 * workers:
                done, future = pending.pop(0)
                yield done, future.result()
        for done, future in pending:
            yield done, future.result()


def _write(file: BinaryIO, values: torch.Tensor) -> None:
    """int32 ids or uint8 flags, as their bytes."""
    values = values.contiguous()
    if values.numel():
        size = values.numel() * values.element_size()
        file.write(bytes((ctypes.c_char * size).from_address(values.data_ptr())))


def _with_eos(ids: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, eos: int) -> torch.Tensor:
    """`ids` with `eos` inserted after each document whose `ends` is set (vectorised: one copy per batch)."""
    before = torch.cumsum(ends.to(torch.int64), 0) - ends.to(torch.int64)  # EOS ids written before each document
    out = torch.full((ids.numel() + int(ends.sum()),), eos, dtype=ids.dtype)
    out[torch.arange(ids.numel()) + torch.repeat_interleave(before, lengths)] = ids
    return out


def _check_texts(
    batch: list[Document], ids: torch.Tensor, lengths: torch.Tensor, special: torch.Tensor, has_text: bool
) -> bool:
    """Refuse a text document that is empty or only special tokens; whether the open document has text so far."""
    owner = torch.repeat_interleave(torch.arange(len(batch)), lengths)  # each id's document
    real = (~torch.isin(ids, special)).to(torch.int64)
    counts = torch.zeros(len(batch), dtype=torch.int64).index_add_(0, owner, real)  # non-special ids
    for (content, where, end), count in zip(batch, counts.tolist(), strict=True):
        if isinstance(content, Conversation):  # a chat has an assistant token: _chat_template checked it
            continue
        has_text = has_text or count > 0
        if end and not has_text:
            raise DataError(f"{where}: the document is empty or only special tokens")
        has_text = has_text and not end
    return has_text


def _build(
    paths: Sequence[Path],
    tokenizer: StreamTokenizer,
    text_field: str,
    tokens_path: Path,
    flags_path: Path,
    workers: int,
) -> dict[str, Any]:
    special = torch.tensor(sorted(tokenizer.special_ids), dtype=torch.int32)
    total = documents = chats = 0
    has_text = False  # the current document has a token that is not special
    starting = True  # the next document piece begins a document
    temporary = tokens_path.with_name(f".{tokens_path.name}.{os.getpid()}")
    temporary_flags = flags_path.with_name(f".{flags_path.name}.{os.getpid()}")
    try:
        with temporary.open("wb") as file, temporary_flags.open("wb") as flags_file:
            for batch, (ids, lengths, targets) in _encoded(paths, tokenizer, text_field, workers):
                has_text = _check_texts(batch, ids, lengths, special, has_text)
                ends = torch.tensor([end for _, _, end in batch])
                is_chat = torch.tensor([isinstance(content, Conversation) for content, _, _ in batch])
                with_eos = ends & ~is_chat  # a text document ends with EOS, a chat with its template's end
                out = _with_eos(ids, lengths, with_eos, tokenizer.eos_id)
                flags = _with_eos(targets, lengths, with_eos, TARGET)  # the EOS is predicted
                firsts = torch.cumsum(lengths + with_eos.to(torch.int64), 0) - lengths - with_eos.to(torch.int64)
                begins = torch.cat([torch.tensor([starting]), ends[:-1]])  # the piece before it ended a document
                flags[firsts[begins & (lengths + with_eos.to(torch.int64) > 0)]] |= START
                starting = bool(ends[-1])
                _write(file, out)
                _write(flags_file, flags)
                total += out.numel()
                documents += int(ends.sum())
                chats += int(is_chat.sum())
            for handle in (file, flags_file):
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(temporary_flags, flags_path)
        os.replace(temporary, tokens_path)
    finally:
        temporary.unlink(missing_ok=True)
        temporary_flags.unlink(missing_ok=True)
    return {
        "version": _VERSION,
        "tokens": total,
        "documents": documents,
        "chats": chats,
        "dtype": "int32",
        "byteorder": sys.byteorder,
        "tokenizer": tokenizer.fingerprint,
        "chat_rule": tokenizer.chat_rule,
        "text_field": text_field,
        "files": [str(p) for p in paths],
    }
