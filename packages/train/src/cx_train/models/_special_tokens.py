"""The special token ids a saved transformers config carries, from the tokenizer cx-train trained with, so that
`generate()` on a checkpoint stops where the training data ended a document, and only there.

The built-in character encoding has no special tokens (no id means end of text: its id 0 is the space, which the
presets' configs once named as EOS, so `generate()` stopped after the first word); the UTF-8 byte encoding of
`--data` ends documents with its EOS id; a model folder's tokenizer has its own bos / eos / pad ids.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SPECIAL_TOKEN_FIELDS", "special_token_ids", "write_special_tokens"]

SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def special_token_ids(tokenizer: Any) -> dict[str, int | None]:
    """bos / eos / pad ids of a cx-train tokenizer: a transformers tokenizer's (`hf_tokenizer`), an `eos_id` attribute
    (the byte encoding's), or none (the character encoding)."""
    inner = getattr(tokenizer, "hf_tokenizer", None)
    if inner is not None:
        return {field: _id(getattr(inner, field, None)) for field in SPECIAL_TOKEN_FIELDS}
    return {"bos_token_id": None, "eos_token_id": _id(getattr(tokenizer, "eos_id", None)), "pad_token_id": None}


def _id(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def write_special_tokens(target: Any, ids: dict[str, int | None], keep_unknown: bool) -> None:
    """Set the ids on a config or generation config; with `keep_unknown`, an id the tokenizer lacks keeps the
    target's own value (a model folder's config), otherwise it becomes None (the built-in presets)."""
    for field, value in ids.items():
        if value is not None or not keep_unknown:
            setattr(target, field, value)
