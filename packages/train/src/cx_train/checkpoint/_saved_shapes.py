"""The tensor shapes a saved model holds, read from its safetensors files' headers only (the format: an 8-byte
little-endian header length, then a JSON object of name -> dtype, shape, offsets), so that `--resume` can compare
them with this run's model before any process starts, without reading a weight."""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["saved_shapes"]


def saved_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every `*.safetensors` file in `model_dir`; empty when there is none or one cannot
    be read (the checksum verification names a damaged file)."""
    shapes: dict[str, tuple[int, ...]] = {}
    try:
        for path in sorted(model_dir.glob("*.safetensors")):
            with path.open("rb") as file:
                (length,) = struct.unpack("<Q", file.read(8))
                header = json.loads(file.read(length))
            for name, entry in header.items():
                if name != "__metadata__":
                    shapes[name] = tuple(int(size) for size in entry["shape"])
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError):
        return {}
    return shapes
