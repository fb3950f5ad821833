"""Hugging Face side files: a `transformers` model's `config.json` (and `generation_config.json`) beside its weights.

The files are rendered into memory at save time (in the caller's thread, so an async save writes the config as it
was when `save_model` was called) and written into the checkpoint directory before it is committed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["hf_side_files", "write_side_files"]


def hf_side_files(model: nn.Module) -> dict[str, bytes]:
    """File name -> content of the config files a `transformers` model would save; empty for other models."""
    files: dict[str, bytes] = {}
    candidates: list[Any] = [getattr(model, "config", None), getattr(model, "generation_config", None)]
    holders = [h for h in candidates if h is not None and callable(getattr(h, "save_pretrained", None))]
    if not holders:
        return files
    scratch = Path(tempfile.mkdtemp(prefix="cx-hf-config-"))
    try:
        for holder in holders:
            holder.save_pretrained(str(scratch))
        for path in sorted(scratch.iterdir()):
            if path.is_file():
                files[path.name] = path.read_bytes()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return files


def write_side_files(directory: Path, files: dict[str, bytes]) -> None:
    for name, content in files.items():
        (directory / name).write_bytes(content)
