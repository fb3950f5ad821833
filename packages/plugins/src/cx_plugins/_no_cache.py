"""A boosted transformers model computes a loss without building a key/value cache.

transformers creates a cache on any forward whose `use_cache` resolves to True, and the default comes from the
model's config, True in most pretrained configs. With a cache, its mask builder skips the packed-sequence detection
(`masking_utils._preprocess_mask_arguments` looks for restarting `position_ids` only when the cache is None), so a
packed batch's documents attend to each other: the loss of a Llama whose config says use_cache=True is 4.1648 on the
packed test batch where the documents one at a time give 4.1666. A training or loss forward never reads the cache, so
`Booster.boost` makes such calls pass `use_cache=False` when the caller did not choose. Generation passes use_cache
explicitly and keeps it; pipeline stages already pass use_cache=False.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

__all__ = ["forward_without_cache"]


def _takes_use_cache(model: nn.Module) -> bool:
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "use_cache" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def _without_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Any, dict[str, Any]] | None:
    if "use_cache" in kwargs or not (module.training or kwargs.get("labels") is not None):
        return None
    return args, {**kwargs, "use_cache": False}


def forward_without_cache(model: nn.Module) -> None:
    """On `model` (a transformers model: its config has `use_cache`), training forwards and forwards given labels
    run with use_cache=False unless the caller passes use_cache. Other modules are left alone."""
    if not hasattr(getattr(model, "config", None), "use_cache") or not _takes_use_cache(model):
        return
    model.register_forward_pre_hook(_without_cache, with_kwargs=True)
