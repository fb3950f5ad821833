"""One tensor file on disk: write a safetensors or legacy `.bin` file, check a safetensors header, load a `.bin` safely,
and tell the two formats apart by their first bytes (a file's name need not say which it is).

Safetensors files are written by a small deterministic serializer (header metadata `{"cx_kind": ..., "format": "pt"}`)
and verified on load by reading the header ourselves: the file size must be exactly 8 + header length + data length,
so a truncated file is reported as such. Legacy `.bin` files are read only with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cx_checkpoint._checksum import CHECKSUM_ALGORITHM, BackgroundCrc32, checksum_of, file_checksum
from cx_checkpoint._errors import CorruptShardError, UnsafeCheckpointError
from cx_checkpoint._json_codec import parse_json
from cx_checkpoint._naming import FileFormat

__all__ = [
    "DATA_CHECKSUM_KEY",
    "HEADER_CHECKSUM_KEY",
    "SafetensorsHeader",
    "alias_key",
    "header_checksum",
    "load_bin",
    "read_safetensors_header",
    "sniff_format",
    "write_bin",
    "write_safetensors",
]

DATA_CHECKSUM_KEY = "cx_data_checksum"
"""Header metadata key of a single safetensors file: the checksum of its data section (a file cannot hold its own)."""
HEADER_CHECKSUM_KEY = "cx_header_checksum"
"""Header metadata key of a single safetensors file: the checksum of its header JSON bytes as written with this
entry's value replaced by a zero placeholder (it covers dtypes, shapes, offsets, the optimizer description)."""

_MAX_HEADER_BYTES = 100 * 1024 * 1024
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def alias_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """Equal for two tensors exactly when they are the same view of the same memory (tied weights)."""
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())


def _standalone(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors detached, on CPU and contiguous (copies are made only where needed, once per aliased view)."""
    out: dict[str, torch.Tensor] = {}
    done: dict[tuple[object, ...], torch.Tensor] = {}
    for name, tensor in tensors.items():
        key = alias_key(tensor)
        if key not in done:
            t = tensor.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            done[key] = t if t.is_contiguous() else t.contiguous()
        out[name] = done[key]
    return out


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], *, checksum_in_header: bool = False
) -> str:
    """Write `tensors` to a safetensors file at `path` (not yet fsynced), byte-for-byte deterministically.

    Returns the checksum of the whole file, computed while writing; with `checksum_in_header` (single-file
    checkpoints, which have no index to hold it) the data section's checksum is computed first, stored in the
    header metadata under `DATA_CHECKSUM_KEY` and returned instead, and the header's own checksum is stored under
    `HEADER_CHECKSUM_KEY` (see `header_checksum`).

    The layout is the safetensors specification's: an 8-byte little-endian header length, a JSON header padded
    with spaces to a multiple of 8 (`__metadata__` first, keys sorted), then the tensors' bytes back to back, widest
    dtype first and by name. `safetensors.torch.save_file` is not used because its metadata order varies between
    calls, which would break the promise that an asynchronous save is byte-identical to a synchronous one.
    """
    prepared = _standalone(tensors)
    order = sorted(prepared, key=lambda name: (-prepared[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for name in order:
        tensor = prepared[name]
        if tensor.dtype not in _DTYPE_NAMES:
            raise TypeError(f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    placeholder = f"{CHECKSUM_ALGORITHM}:{0:08x}"
    if checksum_in_header:  # fixed-width placeholders, filled in once the data has been written
        entries = {**metadata, DATA_CHECKSUM_KEY: placeholder, HEADER_CHECKSUM_KEY: placeholder}
        header["__metadata__"] = dict(sorted(entries.items()))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    crc = BackgroundCrc32()
    with path.open("wb") as handle:
        for piece in (struct.pack("<Q", len(encoded)), encoded):
            handle.write(piece)
            if not checksum_in_header:
                crc.update(piece)
        for name in order:
            tensor = prepared[name]
            if tensor.numel():
                data = _bytes_of(tensor)
                crc.update(data)
                handle.write(data)
        checksum = crc.hexdigest()
        if checksum_in_header:
            encoded = _with_value(encoded, DATA_CHECKSUM_KEY, checksum)
            encoded = _with_value(encoded, HEADER_CHECKSUM_KEY, checksum_of(encoded))
            handle.seek(8)
            handle.write(encoded)
    return checksum


def _value_span(encoded: bytes, key: str) -> tuple[int, int] | None:
    """Where the checksum value of metadata entry `key` lies in a compact header's bytes (None: no such entry).

    The pattern `"key":"crc32:` cannot occur elsewhere: inside a JSON string its quotes would be escaped, and a
    tensor entry's value is an object."""
    marker = f'"{key}":"{CHECKSUM_ALGORITHM}:'.encode()
    start = encoded.find(marker)
    if start < 0:
        return None
    begin = start + len(marker) - len(CHECKSUM_ALGORITHM) - 1
    end = encoded.find(b'"', begin)
    return (begin, end) if end > begin else None


def _with_value(encoded: bytes, key: str, value: str) -> bytes:
    span = _value_span(encoded, key)
    if span is None or span[1] - span[0] != len(value):
        raise AssertionError(f"no fixed-width {key} entry in the header")  # the writer put a placeholder there
    return encoded[: span[0]] + value.encode() + encoded[span[1] :]


def header_checksum(encoded: bytes) -> str | None:
    """The checksum of a single file's header bytes `encoded` as written (its `HEADER_CHECKSUM_KEY` value replaced
    by the zero placeholder), to compare with that value; None when the header carries no such entry."""
    span = _value_span(encoded, HEADER_CHECKSUM_KEY)
    if span is None:
        return None
    placeholder = f"{CHECKSUM_ALGORITHM}:{0:08x}".encode()
    return checksum_of(encoded[: span[0]] + placeholder + encoded[span[1] :])


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes (numpy is not a dependency of cx-checkpoint).

    The view points into the tensor's storage; callers keep the tensor alive while it is used.
    """
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        raise ValueError("safetensors payloads are written from contiguous CPU tensors")
    return memoryview((ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())).cast("B")


def write_bin(path: Path, tensors: Mapping[str, torch.Tensor]) -> str:
    """Write a legacy `pytorch_model.bin`-style file: `torch.save` of a plain name -> tensor dict; returns the
    file's checksum (read back once: torch.save writes through its own zip writer)."""
    plain = {}
    copies: dict[int, torch.Tensor] = {}
    for name, tensor in _standalone(tensors).items():
        # torch.save stores whole storages: a view of a larger storage would drag all of it along. Aliases (tied
        # weights) stay one tensor, so the file is the same whether or not the tensors were staged first.
        if tensor.untyped_storage().nbytes() != tensor.nbytes:
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.clone()
            tensor = copies[id(tensor)]
        plain[name] = tensor
    torch.save(plain, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        return file_checksum(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed safetensors header: tensor name -> (dtype, shape, byte size), plus the string metadata."""

    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]]
    metadata: dict[str, str]
    offsets: dict[str, int] = field(default_factory=dict)
    """tensor name -> its first byte, relative to the data section."""
    data_start: int = 0
    """Byte offset of the data section in the file (8 + header length)."""
    data_bytes: int = 0


def read_safetensors_header(path: Path, fd: int | None = None) -> SafetensorsHeader:
    """Parse and check `path`'s header (read through `fd` when given) against the file size; `CorruptShardError`
    names what is wrong."""
    if fd is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return read_safetensors_header(path, fd)
        finally:
            os.close(fd)
    size = os.fstat(fd).st_size
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        raise CorruptShardError(
            f"{path}: truncated safetensors file ({size} bytes, shorter than its 8-byte header length)"
        )
    (header_length,) = struct.unpack("<Q", prefix)
    if header_length > min(size - 8, _MAX_HEADER_BYTES):
        raise CorruptShardError(
            f"{path}: header claims {header_length} bytes but the file has {size} bytes (truncated or not safetensors)"
        )
    raw = os.pread(fd, header_length, 8)
    header = parse_json(raw, str(path), CorruptShardError, "the safetensors header JSON")
    if not isinstance(header, dict):
        raise CorruptShardError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CorruptShardError(f"{path}: safetensors __metadata__ is not a JSON object")
    tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
    offsets: dict[str, int] = {}
    extents: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptShardError(f"{path}: malformed header entry for tensor {name!r}: {entry!r}") from error
        nbytes = math.prod(shape) * dtype.itemsize
        if min(shape, default=0) < 0 or stop - begin != nbytes:
            raise CorruptShardError(
                f"{path}: header entry for tensor {name!r} is inconsistent: shape {list(shape)} of "
                f"{entry['dtype']} is {nbytes} bytes but data_offsets {[begin, stop]} span {stop - begin}"
            )
        tensors[name] = (dtype, shape, nbytes)
        offsets[name] = begin
        extents.append((begin, stop, name))
    # safetensors requires the tensors to tile the data section exactly: no gap, no overlap
    end = 0
    for begin, stop, name in sorted(extents):
        if begin != end:
            raise CorruptShardError(
                f"{path}: tensor {name!r} starts at data byte {begin}, expected {end} (gap or overlap in the header)"
            )
        end = stop
    expected = 8 + header_length + end
    if size != expected:
        raise CorruptShardError(
            f"{path}: file size is {size} bytes but its header describes {expected} bytes "
            f"({'truncated' if size < expected else 'trailing data'})"
        )
    metadata_text = {str(k): str(v) for k, v in metadata.items()}
    return SafetensorsHeader(tensors, metadata_text, offsets, 8 + header_length, end)


def sniff_format(fd: int) -> FileFormat | None:
    """The format of the open file `fd` told by its first bytes, or None when they look like neither.

    A safetensors file starts with an 8-byte little-endian header length and then the header's `{`; a torch.save
    file is a zip archive (`PK\\x03\\x04`) or, in the old format, a pickle (protocol 2+ starts with `\\x80`). The
    safetensors test comes before the pickle one because a header of 128 bytes (or 384, ...) also starts with
    `\\x80`. Nothing is parsed or unpickled here: the loaders check the content (and refuse pickled code) afterwards.
    """
    head = os.pread(fd, 9, 0)
    if head.startswith(b"PK\x03\x04"):
        return FileFormat.BIN
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= _MAX_HEADER_BYTES:
        return FileFormat.SAFETENSORS
    if head[:1] == b"\x80":
        return FileFormat.BIN
    return None


def load_bin(path: Path, fd: int | None = None) -> dict[str, torch.Tensor]:
    """Load a legacy `.bin` state dict with `torch.load(weights_only=True)`; refuse anything needing code.

    With `fd`, the file held open is read (memory-mapped through /proc/self/fd where the system has it)."""
    source: Path | str = path
    if fd is not None:
        source = f"/proc/self/fd/{fd}" if os.path.exists(f"/proc/self/fd/{fd}") else path
    try:
        try:
            if fd is not None and source == path:  # no /proc: read the open file, unmapped
                with os.fdopen(os.dup(fd), "rb") as handle:
                    loaded = torch.load(handle, map_location="cpu", weights_only=True)
            else:
                loaded = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            loaded = torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnsafeCheckpointError(
            f"{path}: refused to load this pickle file: it needs arbitrary code to load (torch.load with "
            f"weights_only=True rejected it: {str(error).splitlines()[0]}). Only plain tensor files are accepted."
        ) from error
    except (EOFError, RuntimeError) as error:
        raise CorruptShardError(
            f"{path}: cannot read this .bin file (truncated or not a torch file): {error}"
        ) from error
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise CorruptShardError(f"{path}: a .bin weights file must hold a dict of name -> tensor")
    return loaded
