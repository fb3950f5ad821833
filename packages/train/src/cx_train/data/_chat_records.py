"""What kind of record a data file holds, and chat records read into `Conversation`s.

A record with `messages` (a list of `{role, content}`) is a chat; one with `prompt` and `completion` is a chat of
one user turn and one assistant turn (or, as in TRL's conversational prompt-completion format, two lists of messages
joined); one with the text field is plain text. A file holds one kind: the first record decides it, and a record of
another kind is refused with its line or row.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CHAT_KINDS", "Conversation", "DataError", "conversation", "record_kind"]

CHAT_KINDS = ("messages", "prompt-completion")


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file and the line or row."""


@dataclass(frozen=True)
class Conversation:
    """A chat's turns as (role, content) pairs: plain data, so batches of them travel to tokenising processes."""

    turns: tuple[tuple[str, str], ...]

    def messages(self, stop: int | None = None) -> list[dict[str, str]]:
        """The first `stop` turns (all by default) as the `{role, content}` dicts chat templates read."""
        return [{"role": role, "content": content} for role, content in self.turns[:stop]]


def record_kind(fields: Collection[str], text_field: str) -> str | None:
    """ "messages", "prompt-completion" or "text" from a record's fields (or a table's columns); None for none."""
    if "messages" in fields:
        return "messages"
    if "prompt" in fields and "completion" in fields:
        return "prompt-completion"
    return "text" if text_field in fields else None


def _turns(value: Any, where: str, field: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: the "{field}" value is {type(value).__name__}, not a list of {{role, content}}')
    turns = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise DataError(f'{where}: "{field}"[{index}] is not a {{role, content}} message')
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(f'{where}: "{field}"[{index}] has a role or content that is not text')
        turns.append((role, content))
    return turns


def conversation(record: Mapping[str, Any], kind: str, where: str) -> Conversation:
    """The chat of a `messages` or `prompt-completion` record; refuses one without an assistant turn."""
    if kind == "messages":
        turns = _turns(record["messages"], where, "messages")
    else:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            turns = [("user", prompt), ("assistant", completion)]
        elif isinstance(prompt, list) and isinstance(completion, list):
            turns = _turns(prompt, where, "prompt") + _turns(completion, where, "completion")
        else:
            raise DataError(f'{where}: "prompt" and "completion" must both be text or both lists of messages')
    if not any(role == "assistant" for role, _ in turns):
        raise DataError(f"{where}: the chat has no assistant turn, so nothing of it would be trained on")
    return Conversation(tuple(turns))
