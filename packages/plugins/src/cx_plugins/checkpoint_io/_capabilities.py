"""What a checkpoint IO can do beyond `cx_checkpoint.CheckpointIO`, as protocols the Booster checks by capability.

The Booster never asks which class a plugin's checkpoint IO is: an IO that keeps an fp16 loss scaler's state with
the optimizer's, or that writes LoRA adapters, says so by having the method (`isinstance` on these protocols).
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from torch import nn
from torch.optim import Optimizer

from cx_checkpoint import Stateful

__all__ = ["KeepsLossScaler", "SavesLora"]


@runtime_checkable
class KeepsLossScaler(Protocol):
    """Saves and loads a loss scaler's state with its optimizer's (the Booster's fp16 GradScaler)."""

    def register_loss_scaler(self, optimizer: Optimizer, scaler: Stateful) -> None: ...


@runtime_checkable
class SavesLora(Protocol):
    """Writes a boosted model's LoRA adapters in peft's folder format."""

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None: ...
