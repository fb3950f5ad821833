"""`--data` / `--eval-data` read as documents: plain text files (one document per file), JSON Lines (one document per
line, its `text` field or `--text-field`), Parquet (one per row of that column) and folders written by
`datasets.Dataset.save_to_disk`. pyarrow and datasets are imported only for their formats, with an install hint.
A JSON line, row or dataset with `messages` or `prompt` / `completion` is a chat record (`_chat_records`), read as a
`Conversation`; a file holds one kind of record.

Every document comes with where it is (`file:line N` / `file: row N`), so that bad data is refused with an error
naming the file and the line or row: an empty file, a JSON line that is not JSON or lacks the field, a Parquet file
or dataset without the column, a null or non-text value.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cx_train.data._chat_records import CHAT_KINDS, Conversation, DataError, conversation, record_kind

__all__ = ["DataError", "Document", "data_format", "file_kind", "iter_documents", "resolve_data_paths"]

# (text or chat, where it is: "file:line N", "file: row N" or "file", whether the document ends here: a plain text
# file is one document read in several blocks)
Document = tuple[str | Conversation, str, bool]
_JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_TEXT_BLOCK = 1 << 20  # plain text is read in blocks of whole lines of about this many characters


def resolve_data_paths(patterns: Sequence[str], flag: str = "--data") -> list[Path]:
    """Files and dataset folders named by `patterns` (paths or globs), in the order given, each glob sorted."""
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(
                path
                for path in map(Path, glob.glob(pattern, recursive=True))
                if ".cx-token-cache" not in path.parts and (path.is_file() or _is_saved_dataset(path))
            )
            if not matched:
                raise DataError(f"{flag} {pattern}: the pattern matches no file")
            paths += matched
            continue
        path = Path(pattern)
        if not path.exists():
            raise DataError(f"{flag} {pattern}: no such file or folder")
        if not path.is_dir() and not path.is_file():  # /dev/zero would be read forever as one line of NULs
            raise DataError(
                f"{flag} {pattern}: not a regular file (a device, pipe or socket); {flag} reads files, globs of "
                "files or datasets.save_to_disk folders"
            )
        if path.is_dir() and (path / "dataset_dict.json").is_file():
            raise DataError(
                f"{flag} {pattern}: a datasets.DatasetDict folder ({_splits(path)}); pass one split's folder, "
                f"e.g. {flag} '{path / _first_split(path)}'"
            )
        if path.is_dir() and not _is_saved_dataset(path):
            raise DataError(
                f"{flag} {pattern}: a folder, but not one written by datasets.Dataset.save_to_disk (no state.json); "
                f"name its files, e.g. {flag} '{pattern}/*.txt'"
            )
        paths.append(path)
    return [p for p in dict.fromkeys(p.resolve() for p in paths)]


def _split_names(folder: Path) -> list[str]:
    """The splits a DatasetDict.save_to_disk folder lists (its dataset_dict.json), else its sub-folders."""
    try:
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits")
    except (OSError, ValueError, AttributeError):
        splits = None
    if isinstance(splits, list) and all(isinstance(s, str) for s in splits) and splits:
        return splits
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def _splits(folder: Path) -> str:
    names = _split_names(folder)
    return "splits: " + ", ".join(names) if names else "no splits listed"


def _first_split(folder: Path) -> str:
    names = _split_names(folder)
    return "train" if "train" in names or not names else names[0]


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def data_format(path: Path) -> str:
    """ "dataset" (a save_to_disk folder), "parquet", "jsonl" or "text", from the path."""
    if path.is_dir():
        return "dataset"
    if path.suffix.lower() == ".parquet":
        return "parquet"
    if path.suffix.lower() in _JSON_SUFFIXES:
        return "jsonl"
    return "text"


def iter_documents(path: Path, text_field: str) -> Iterator[Document]:
    """The documents of one file or dataset folder, in order."""
    kind = data_format(path)
    if kind != "dataset" and path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    if kind == "text":
        yield from _text_documents(path)
    elif kind == "jsonl":
        yield from _jsonl_documents(path, text_field)
    elif kind == "parquet":
        yield from _parquet_documents(path, text_field)
    else:
        yield from _dataset_documents(path, text_field)


def _text_documents(path: Path) -> Iterator[Document]:
    """One document per file, in blocks of whole lines (a file larger than memory streams through)."""
    seen_text = False
    with path.open(encoding="utf-8", errors="strict") as file:
        block: list[str] = []
        size = 0
        try:
            for line in file:
                if "\x00" in line:  # valid UTF-8, but a preallocated or crashed file, not text
                    raise DataError(f"{path}: holds NUL bytes (a preallocated or crashed file), not text")
                block.append(line)
                size += len(line)
                if size >= _TEXT_BLOCK:
                    seen_text = seen_text or any(part.strip() for part in block)
                    yield "".join(block), f"{path}", False
                    block, size = [], 0
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text ({error})") from None
        seen_text = seen_text or any(part.strip() for part in block)
        if not seen_text:
            raise DataError(f"{path}: the file holds only whitespace")
        yield "".join(block), f"{path}", True


def _jsonl_documents(path: Path, text_field: str) -> Iterator[Document]:
    documents = 0
    kind: tuple[str, int] | None = None  # the file's kind and the line that set it
    with path.open(encoding="utf-8") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path}:line {number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{where}: not a JSON object ({error.msg})") from None
            this = record_kind(record, text_field) if isinstance(record, dict) else None
            if this is None:
                keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
                raise DataError(
                    f'{where}: no "{text_field}" field (it has: {keys}); name the field with --text-field, or give '
                    'chat records "messages" or "prompt" and "completion"'
                )
            if kind is None:
                kind = (this, number)
            elif this != kind[0]:
                raise DataError(
                    f"{where}: a {this} record in a file of {kind[0]} records (line {kind[1]}); a file holds one "
                    "kind of record"
                )
            yield _value(record, this, where, text_field), where, True
            documents += 1
    if not documents:
        raise DataError(f"{path}: the file holds no JSON lines")


def _value(record: dict[str, Any], kind: str, where: str, text_field: str) -> str | Conversation:
    if kind in CHAT_KINDS:
        return conversation(record, kind, where)
    return _text_value(record[text_field], where, text_field)


def _text_value(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise DataError(f'{where}: the "{field}" value is {type(value).__name__}, not text')
    return value


def _optional(module: str, extra_for: str) -> Any:
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise DataError(
            f"{extra_for} needs the {module.split('.')[0]} library, which is not installed: "
            "pip install 'cx-train[data]'"
        ) from None


def _table_kind(path: Path, names: list[str], text_field: str, what: str) -> tuple[str, list[str]]:
    """The kind of a Parquet file's or dataset's rows (from its columns) and the columns to read."""
    kind = record_kind(names, text_field)
    if kind is None:
        raise DataError(f'{path}: no "{text_field}" {what} (it has: {", ".join(names)}); name it with --text-field')
    columns = {"messages": ["messages"], "prompt-completion": ["prompt", "completion"]}.get(kind, [text_field])
    return kind, columns


def _rows(
    path: Path, kind: str, columns: list[str], text_field: str, rows: Iterator[dict[str, list[Any]]]
) -> Iterator[Document]:
    row = 0
    for batch in rows:
        for values in zip(*(batch[name] for name in columns), strict=True):
            where = f"{path}: row {row}"
            yield _value(dict(zip(columns, values, strict=True)), kind, where, text_field), where, True
            row += 1


def _parquet_documents(path: Path, text_field: str) -> Iterator[Document]:
    parquet = _optional("pyarrow.parquet", f"{path} (Parquet)")
    file = parquet.ParquetFile(str(path))
    kind, columns = _table_kind(path, list(file.schema_arrow.names), text_field, "column")
    if file.metadata.num_rows == 0:
        raise DataError(f"{path}: the Parquet file has no rows")
    batches = (batch.to_pydict() for batch in file.iter_batches(columns=columns, batch_size=1024))
    yield from _rows(path, kind, columns, text_field, batches)


def _dataset_documents(path: Path, text_field: str) -> Iterator[Document]:
    datasets = _optional("datasets", f"{path} (a datasets.save_to_disk folder)")
    dataset = datasets.load_from_disk(str(path))
    if not hasattr(dataset, "column_names") or isinstance(dataset.column_names, dict):
        raise DataError(f"{path}: a DatasetDict; pass one split's folder (e.g. {path}/train)")
    kind, columns = _table_kind(path, list(dataset.column_names), text_field, "column")
    if len(dataset) == 0:
        raise DataError(f"{path}: the dataset has no rows")
    yield from _rows(path, kind, columns, text_field, dataset.select_columns(columns).iter(batch_size=1024))


def file_kind(path: Path, text_field: str) -> str:
    """ "text" or "chat": what `path`'s documents are (its first record decides; `iter_documents` checks the rest)."""
    for content, _, _ in iter_documents(path, text_field):
        return "chat" if isinstance(content, Conversation) else "text"
    return "text"
