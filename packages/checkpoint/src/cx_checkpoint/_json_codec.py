"""A tagged JSON encoding for the non-tensor state (param groups, scheduler state) that keeps Python types exact.

Plain JSON loses tuples (Adam's `betas`), non-string dict keys (MultiStepLR's milestone Counter) and Counters, so
those are written as `{"__cx__": "tuple" | "dict" | "counter", "items": [...]}`. Anything that is not plain data
(tensors, functions, objects) is refused with an error naming where it was found: no pickle, no silent loss.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

__all__ = ["decode", "encode", "parse_json"]

_TAG = "__cx__"


def encode(value: Any, where: str) -> Any:
    """`value` as JSON-ready data; `where` names the value in the error for unsupported types."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_TAG: "float", "value": repr(value)}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, Counter):
        return {_TAG: "counter", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return {_TAG: "dict", "items": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which cx checkpoints cannot store "
        "(only None, bool, int, float, str, list, tuple, dict and Counter values, or tensors in optimizer state)"
    )


def decode(data: Any) -> Any:
    """Inverse of `encode`."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if isinstance(data, dict):
        tag = data.get(_TAG)
        if tag is None:
            return {k: decode(v) for k, v in data.items()}
        if tag == "float":
            return float(data["value"])
        if tag == "tuple":
            return tuple(decode(v) for v in data["items"])
        if tag == "dict":
            return {_hashable(decode(k)): decode(v) for k, v in data["items"]}
        if tag == "counter":
            return Counter({_hashable(decode(k)): decode(v) for k, v in data["items"]})
        raise ValueError(f"unknown tagged value {tag!r} in checkpoint JSON")
    return data


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name} (not JSON)")


def parse_json(text: str | bytes, where: str, error: type[Exception], what: str) -> Any:
    """Parse checkpoint JSON; anything wrong with it (bad syntax or encoding, NaN/Infinity literals, nesting too deep
    for Python) becomes `error` naming `where` and `what`, never a raw Python error."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise error(f"{where}: {what} is nested too deeply to be a checkpoint file (refused)") from None
    except (UnicodeDecodeError, ValueError) as cause:  # json.JSONDecodeError is a ValueError
        raise error(f"{where}: {what} is not valid JSON: {cause}") from cause
