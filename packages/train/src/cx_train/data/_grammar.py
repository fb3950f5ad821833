"""cx-train's embedded dataset: text from a small seeded grammar, tokenised by character. Needs no download.

The grammar has enough structure (agreement between subject and verb, fixed phrase shapes, punctuation) that a small
model's loss falls from ln(vocab) toward ~1 nat per character within a few hundred steps on a CPU, which is what a
demo must show, and it is identical on every machine and every run.
"""

from __future__ import annotations

import itertools
import random
from typing import Protocol

import torch
from torch.utils.data import Dataset

__all__ = ["CharTokenizer", "GrammarText", "TextEncoder", "TokenWindows"]

_SUBJECTS = {
    "singular": ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"],
    "plural": ["the cats", "two dogs", "the children", "our neighbours", "the robots", "many birds"],
}
_VERBS = {
    "singular": ["sees", "likes", "follows", "paints", "finds", "carries", "remembers"],
    "plural": ["see", "like", "follow", "paint", "find", "carry", "remember"],
}
_OBJECTS = ["the river", "a red ball", "the green door", "an apple", "the moon", "a quiet song", "the long road"]
_ENDINGS = ["today", "at night", "every morning", "in the garden", "after school", "before the rain"]


class GrammarText:
    """Deterministic sentences: `GrammarText(seed).generate(n_chars)`."""

    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)

    def sentence(self) -> str:
        number = self._random.choice(("singular", "plural"))
        words = [self._random.choice(_SUBJECTS[number]), self._random.choice(_VERBS[number])]
        words.append(self._random.choice(_OBJECTS))
        if self._random.random() < 0.6:
            words.append(self._random.choice(_ENDINGS))
        text = " ".join(words)
        return text[0].upper() + text[1:] + self._random.choice((".", ".", "!", "?")) + " "

    def generate(self, n_chars: int) -> str:
        parts: list[str] = []
        length = 0
        while length < n_chars:
            parts.append(self.sentence())
            length += len(parts[-1])
        return "".join(parts)[:n_chars]


class TextEncoder(Protocol):
    """What cx-train needs of a tokenizer: its vocabulary size and text -> a 1-D tensor of token ids."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> torch.Tensor: ...


class CharTokenizer:
    """Characters to ids over a fixed alphabet (every character the grammar can produce)."""

    def __init__(self) -> None:
        phrases = itertools.chain(*_SUBJECTS.values(), *_VERBS.values(), _OBJECTS, _ENDINGS)
        corpus = " ".join(phrases)
        alphabet = sorted(set(corpus) | set(corpus.upper()) | set(".!? "))
        self.alphabet = "".join(alphabet)
        self._ids = {c: i for i, c in enumerate(self.alphabet)}

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> torch.Tensor:
        try:
            return torch.tensor([self._ids[c] for c in text], dtype=torch.long)
        except KeyError as missing:
            raise ValueError(f"character {missing} is not in the character alphabet") from None

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.alphabet[int(i)] for i in ids)


class TokenWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of `length` token ids over the generated text, tokenised by `tokenizer` (by default
    the character alphabet; a model folder's own tokenizer packs several characters into a token, so more text is
    generated until the windows are full)."""

    def __init__(self, n_windows: int, length: int, seed: int = 0, tokenizer: TextEncoder | None = None) -> None:
        self.tokenizer: TextEncoder = CharTokenizer() if tokenizer is None else tokenizer
        needed, chars = n_windows * length, n_windows * length
        ids = self.tokenizer.encode(GrammarText(seed).generate(chars))
        while ids.numel() < needed:
            chars *= 2
            ids = self.tokenizer.encode(GrammarText(seed).generate(chars))
        self._windows = ids[:needed].view(n_windows, length)

    def __len__(self) -> int:
        return self._windows.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._windows[index]
