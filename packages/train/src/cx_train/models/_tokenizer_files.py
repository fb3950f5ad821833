"""The tokenizer a checkpoint was trained with: its identity (a hash of what maps text to ids, recorded in
`trainer.json`, so that `--resume` with another tokenizer, of the same vocabulary size included, is refused) and its
files, written into the checkpoint's `model/` folder beside the weights so that `AutoTokenizer.from_pretrained` and
`--model CKPT/model` read the same ids the model was trained on.

The identity is of the tokenizer's content, not of its files' bytes: a fast tokenizer's whole pipeline
(`backend_tokenizer.to_str()`: normalizer, pre-tokenizer, vocabulary, merges, added tokens) or a slow one's
vocabulary, with the special ids; the files a save writes read back to the same identity.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from cx_train.models._special_tokens import special_token_ids

__all__ = ["TokenizerIdentity", "save_tokenizer", "tokenizer_identity"]


class TokenizerIdentity(str):
    """`<kind>:<vocab size>:<sha256 prefix>`, e.g. `transformers:300:1f2e...` or `ByteTokenizer:257:...`."""

    @property
    def vocab_size(self) -> int:
        return int(self.split(":")[1])

    def describe(self) -> str:
        kind, vocab, digest = self.split(":", 2)
        return f"{kind} tokenizer, vocabulary {vocab}, sha256 {digest}"


def _hf_content(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return str(backend.to_str())
    return json.dumps(sorted(tokenizer.get_vocab().items()))


def tokenizer_identity(tokenizer: Any) -> TokenizerIdentity:
    """The identity of a cx-train tokenizer (`DescribedModel.tokenizer`)."""
    inner = getattr(tokenizer, "hf_tokenizer", None)
    ids = json.dumps(special_token_ids(tokenizer), sort_keys=True)
    if inner is not None:
        kind, content = "transformers", _hf_content(inner)  # not the class: a reload may pick another one
    else:
        kind = type(tokenizer).__name__
        content = str(getattr(tokenizer, "alphabet", None) or getattr(tokenizer, "fingerprint", kind))
    digest = hashlib.sha256(f"{content}\n{ids}".encode()).hexdigest()[:16]
    return TokenizerIdentity(f"{kind}:{tokenizer.vocab_size}:{digest}")


def save_tokenizer(tokenizer: Any, folder: Path) -> list[str]:
    """Write a transformers tokenizer's files into `folder` (the checkpoint's model/, beside config.json), and a
    `generation_config.json` with its eos / bos / pad ids when the model's save wrote none; returns the names
    written. The built-in encodings (characters, UTF-8 bytes) have no files: nothing is written for them."""
    inner = getattr(tokenizer, "hf_tokenizer", None)
    if inner is None:
        return []
    before = {path.name for path in folder.iterdir()}
    inner.save_pretrained(str(folder))
    generation = folder / "generation_config.json"
    if not generation.exists():
        ids = {name: value for name, value in special_token_ids(tokenizer).items() if value is not None}
        generation.write_text(json.dumps({**ids, "_from_model_config": False}, indent=2) + "\n")
    return sorted({path.name for path in folder.iterdir()} - before)
