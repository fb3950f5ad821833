"""A chat rendered with the model's own chat template, and which of its tokens the loss counts: the assistant turns.

Two ways to find them, as TRL's SFT and torchtune do. A template with `{% generation %}` markers says where the
assistant's text is, and a fast tokenizer maps that to tokens (`return_assistant_tokens_mask`). Otherwise each
assistant turn k is the tokens between the rendering of turns [0, k) with the generation prompt and the rendering of
turns [0, k]; both must be prefixes of the whole chat's tokens (a template that renders earlier turns differently
once later ones follow is refused, with the hint to add the markers). Either way the template's end-of-turn tokens
after an assistant's text are targets (the model learns to stop) and the role headers are not.
"""

from __future__ import annotations

import re
from typing import Any

from cx_train.data._chat_records import Conversation, DataError

__all__ = ["chat_rule", "chat_tokens"]

_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def chat_rule(tokenizer: Any) -> str:
    """Which masking rule `chat_tokens` applies with this tokenizer (part of the token cache's key)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return "no-template"
    if _GENERATION.search(template) and getattr(tokenizer, "is_fast", False):
        return "assistant-generation-markers-v1"
    return "assistant-prefix-renders-v1"


def _render(tokenizer: Any, messages: list[dict[str, str]], prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=prompt)
    return [int(i) for i in ids]


def chat_tokens(tokenizer: Any, chat: Conversation, where: str) -> tuple[list[int], list[int]]:
    """The chat's token ids and, per token, 1 where the loss counts it (an assistant turn's token) else 0."""
    rule = chat_rule(tokenizer)
    if rule == "assistant-generation-markers-v1":
        out = tokenizer.apply_chat_template(
            chat.messages(), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = [int(i) for i in out["input_ids"]], [int(m) for m in out["assistant_masks"]]
    else:
        ids = _render(tokenizer, chat.messages(), prompt=False)
        mask = [0] * len(ids)
        for k, (role, _) in enumerate(chat.turns):
            if role != "assistant":
                continue
            before = _render(tokenizer, chat.messages(k), prompt=True)
            through = _render(tokenizer, chat.messages(k + 1), prompt=False)
            if through[: len(before)] != before or ids[: len(through)] != through:
                raise DataError(
                    f"{where}: the chat template does not render turn {k}'s prefix of the chat as a prefix of its "
                    "tokens, so the assistant's tokens cannot be found; add {% generation %} markers to the template"
                )
            mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    if not any(mask):
        raise DataError(f"{where}: the chat template renders no token of the assistant turns, so nothing is trained on")
    return ids, mask
