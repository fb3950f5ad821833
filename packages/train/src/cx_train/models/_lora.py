"""`--lora-rank`: peft's LoRA adapters on the model before it is boosted (`Booster.enable_lora`), so only the
adapters train and the optimizer holds their states alone; a checkpoint then saves the adapters in peft's folder
format (`adapter/`, which `PeftModel.from_pretrained` loads) instead of the weights, and with `--merge-lora` also the
weights with the adapters merged in (`model/`, a plain transformers folder). Under hybrid (tp, pp, zero) and gemini the
adapters are sharded with their base and gathered back into full peft tensors on save; `--merge-lora` needs one
rank's full weights (torch_ddp, low_level_zero)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

from cx_train.config._plugin_flags import LoraSettings

__all__ = ["ADAPTER_FOLDER", "lora_config", "save_merged"]

ADAPTER_FOLDER = "adapter"  # a LoRA checkpoint's adapters, beside optimizer/ and trainer.json


def lora_config(settings: LoraSettings) -> Any:
    """peft's `LoraConfig` for causal language modelling (no dropout: the step is the same on every rank)."""
    import peft  # an optional dependency, imported only under --lora-rank

    targets = settings.targets if isinstance(settings.targets, str) else list(settings.targets)
    return peft.LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, target_modules=targets, lora_dropout=0.0, task_type="CAUSAL_LM"
    )


def save_merged(model: nn.Module, folder: Path) -> None:
    """`model` (a peft model holding full weights on this rank) with its adapters merged into a copy of the base
    weights, written as a transformers folder (safetensors and config.json)."""
    merged = copy.deepcopy(model).merge_and_unload()  # type: ignore[operator]
    merged.save_pretrained(str(folder), safe_serialization=True)
