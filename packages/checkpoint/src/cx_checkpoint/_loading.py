"""`load_into`: verify a checkpoint against a `TensorSink`, then hand it each owned region, one tensor at a time.

Every check (missing and unexpected names under `strict=True`, shapes and dtypes) happens before the first tensor is
handed over, so a refused load leaves the model untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from cx_checkpoint._errors import KeyMismatchError, TensorMismatchError
from cx_checkpoint._protocols import TensorSink
from cx_checkpoint._reader import CheckpointReader

__all__ = ["LoadResult", "load_into"]


@dataclass(frozen=True)
class LoadResult:
    """Names the model expected but the checkpoint lacks, and names the checkpoint has that the model does not."""

    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()


def load_into(reader: CheckpointReader, sink: TensorSink, *, strict: bool = True) -> LoadResult:
    """Load every tensor `sink` expects from `reader`; with `strict`, any name difference is a `KeyMismatchError`."""
    expected = dict(sink.expected_tensors())
    present = reader.specs
    missing = sorted(set(expected) - set(present))
    unexpected = sorted(set(present) - set(expected))
    if strict and (missing or unexpected):
        raise KeyMismatchError(
            f"{reader.index_path or reader.path}: tensor names differ from the model's (strict=True)",
            missing,
            unexpected,
        )
    common = [name for name in reader.names() if name in expected]
    for name in common:
        if present[name] != expected[name]:
            raise TensorMismatchError(
                f"{reader.file_of(name)}: tensor {name!r} is {present[name]} in the checkpoint but the model "
                f"expects {expected[name]}"
            )
    for name in common:
        sink.receive(name, reader.read(name, sink.owned_region(name)))
    return LoadResult(tuple(missing), tuple(unexpected))
