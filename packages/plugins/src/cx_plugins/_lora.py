"""LoRA through Hugging Face peft (an optional dependency, imported only here): adapters added to a model before
`boost`, and saved in peft's own folder format so `PeftModel.from_pretrained` loads them.

cx always writes the adapter as safetensors: peft's other format is a pickle, which cx never writes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["apply_lora", "is_lora_model", "require_lora", "save_lora", "under_adapters"]


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError(
            "LoRA in cx uses Hugging Face peft, which is not installed: pip install 'cx-plugins[lora]' (or peft)"
        ) from error
    return peft


def apply_lora(model: nn.Module, pretrained_dir: str | os.PathLike[str] | None, lora_config: Any) -> nn.Module:
    """`model` with LoRA adapters: new ones from `lora_config`, or trainable ones loaded from `pretrained_dir`."""
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        raise ValueError("enable_lora: the model already has LoRA adapters (it is a peft PeftModel)")
    if pretrained_dir is not None:
        if lora_config is not None:
            warnings.warn(
                "enable_lora: pretrained_dir is given, so its adapter config is used and lora_config is ignored",
                stacklevel=3,
            )
        return peft.PeftModel.from_pretrained(model, str(pretrained_dir), is_trainable=True)  # type: ignore[no-any-return]
    if lora_config is None:
        raise ValueError("enable_lora needs a peft LoraConfig (lora_config=...) or a pretrained adapter directory")
    return peft.get_peft_model(model, lora_config)  # type: ignore[no-any-return]


def is_lora_model(model: nn.Module) -> bool:
    try:
        peft = _peft()
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def under_adapters(model: nn.Module) -> nn.Module:
    """The model a policy shards and a pipeline splits: under LoRA (a peft `PeftModel`, which wraps the user's model
    and edits it in place) the user's model, whose LoRA layers ShardFormer sees through; otherwise `model`."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model) and getattr(model, "peft_config", None) is not None:
        inner = get_base_model()
        if isinstance(inner, nn.Module):
            return inner
    return model


def require_lora(model: nn.Module) -> None:
    """A clear error (on every rank that calls it) for a model without adapters."""
    if not is_lora_model(model):
        raise ValueError(
            f"save_lora_as_pretrained: {type(model).__name__} has no LoRA adapters; call booster.enable_lora before "
            "boost"
        )


def save_lora(
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    use_safetensors: bool,
    adapters: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write `model`'s adapters in peft's folder format: the ones it holds (full weights on this rank), or
    `adapters` (full tensors under the model's parameter names, gathered from a sharded model)."""
    require_lora(model)
    if not use_safetensors:
        warnings.warn(
            "save_lora_as_pretrained: use_safetensors=False would write a pickle; cx writes safetensors, which "
            "PeftModel.from_pretrained loads the same way",
            stacklevel=3,
        )
    Path(checkpoint).mkdir(parents=True, exist_ok=True)
    extra = {} if adapters is None else {"state_dict": dict(adapters)}
    model.save_pretrained(str(checkpoint), safe_serialization=True, **extra)  # type: ignore[operator]
