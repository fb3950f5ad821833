"""`pick_options`: an engine constructor takes either ColossalAI's flat option keywords or one options group."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["pick_options"]

T = TypeVar("T")


def pick_options(given: T | None, from_keywords: T, defaults: T, owner: str) -> T:
    """`given` when the caller passed a group (then every option keyword must be at its default, so none is
    silently dropped), else the group built from the keywords."""
    if given is None:
        return from_keywords
    if from_keywords != defaults:
        raise ValueError(
            f"{owner}: pass either options= or the option keywords, not both (options={given!r}, keywords give "
            f"{from_keywords!r})"
        )
    return given
