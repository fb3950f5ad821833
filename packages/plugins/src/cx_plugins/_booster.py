"""`Booster`: the user's entry point. It validates the plugin/precision pairing, asks the plugin to configure the
training objects, and routes backward, no_sync and checkpointing through the plugin."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import DEFAULT_SIZE_PER_SHARD, CheckpointIO
from cx_mesh import get_accelerator
from cx_plugins._dp_checkpoint_io import ReplicatedCheckpointIO
from cx_plugins._plugin import Boosted, Plugin
from cx_plugins._precision import AutocastModel, Precision, ScaledOptimizer
from cx_plugins._settings import check_boost_settings
from cx_plugins._wrappers import ModelWrapper, OptimizerWrapper

__all__ = ["Booster"]


class Booster:
    """Boost a model/optimizer/dataloader for distributed training with a plugin (ColossalAI's Booster API)."""

    def __init__(self, device: str | None = None, mixed_precision: str | None = None, plugin: Plugin | None = None):
        if plugin is None:
            raise ValueError("Booster needs a plugin (e.g. TorchDDPPlugin()); cx has no implicit plugin-less mode")
        self.plugin = plugin
        if device is not None and device not in plugin.supported_devices():
            raise ValueError(
                f"device {device!r} is not supported by {type(plugin).__name__}: {plugin.supported_devices()}"
            )
        if device is not None and device != get_accelerator().name:
            raise ValueError(f"device {device!r} differs from this process's accelerator {get_accelerator().name!r}")
        if plugin.control_precision() and mixed_precision is not None:
            raise ValueError(
                f"{type(plugin).__name__} controls precision itself: pass precision to the plugin, "
                "not mixed_precision to the Booster"
            )
        accepted = tuple(Precision(p) for p in plugin.supported_precisions())
        self.mixed_precision = Precision.parse(mixed_precision, accepted)
        self._checkpoint_io: CheckpointIO | None = None

    def boost(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Returns (model, optimizer, criterion, dataloader, lr_scheduler), each ready for distributed training."""
        check_boost_settings(self.plugin, self.mixed_precision.value, optimizer)
        boosted_model, boosted_optimizer, criterion, dataloader, lr_scheduler = self.plugin.configure(
            model, optimizer, criterion, dataloader, lr_scheduler
        )
        if self.mixed_precision is not Precision.FP32 and not isinstance(boosted_model, AutocastModel):
            boosted_model = AutocastModel(boosted_model, self.mixed_precision)
            if self.mixed_precision is Precision.FP16 and boosted_optimizer is not None:
                scaled = ScaledOptimizer(boosted_optimizer.unwrap())
                boosted_optimizer = scaled
                io = self.checkpoint_io
                if isinstance(io, ReplicatedCheckpointIO):  # checkpoints keep the loss scale
                    io.register_loss_scaler(scaled.unwrap(), scaled.scaler)
        return boosted_model, boosted_optimizer, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Backward through the optimizer wrapper, so loss scaling and gradient reduction happen where they must."""
        optimizer.backward(loss)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation without communication, where the plugin supports it (else the plugin says why)."""
        return self.plugin.no_sync(model, optimizer)

    def execute_pipeline(self, *args: Any, **kwargs: Any) -> Any:
        if not self.plugin.supports_pipeline():
            raise NotImplementedError(
                f"execute_pipeline needs a plugin with pipeline parallelism; {type(self.plugin).__name__} has none "
                "(the HybridParallel plugins that provide it are not built yet)"
            )
        raise NotImplementedError("no cx plugin implements pipeline execution yet")

    def enable_lora(
        self,
        model: nn.Module,
        pretrained_dir: str | os.PathLike[str] | None = None,
        lora_config: Any = None,
        bnb_quantization_config: Any = None,
        quantize: bool = False,
    ) -> nn.Module:
        """Add LoRA adapters (Hugging Face peft) to `model`, new from `lora_config` (a `peft.LoraConfig`) or loaded
        trainable from `pretrained_dir`; call it before `boost` and build the optimizer from the returned model."""
        if quantize or bnb_quantization_config is not None:
            raise NotImplementedError("enable_lora: quantised base weights (bitsandbytes) are not supported in cx")
        if isinstance(model, ModelWrapper):
            raise ValueError("enable_lora must be called before boost (this model is already boosted)")
        return self.plugin.enable_lora(model, None if pretrained_dir is None else str(pretrained_dir), lora_config)

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None:
        """Save the LoRA adapters of a boosted model in peft's format (loadable by `PeftModel.from_pretrained` and by
        `enable_lora(pretrained_dir=...)`); always safetensors."""
        io = self.checkpoint_io
        if not isinstance(io, ReplicatedCheckpointIO) or not self.plugin.support_lora():
            raise NotImplementedError(f"save_lora_as_pretrained: {type(self.plugin).__name__} does not support LoRA")
        io.save_lora_as_pretrained(model, checkpoint, use_safetensors)

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The plugin's checkpoint IO, created once per Booster (it owns the asynchronous writer)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = self.plugin.get_checkpoint_io()
        return self._checkpoint_io

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = DEFAULT_SIZE_PER_SHARD,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save full weights by parameter name (Hugging Face layout); `size_per_shard` is in MB."""
        self.checkpoint_io.save_model(
            model, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async
        )

    def load_model(self, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True) -> None:
        """Load a cx/HF checkpoint into `model`; with `strict`, missing or unexpected keys are errors."""
        self.checkpoint_io.load_model(model, checkpoint, strict=strict)

    def save_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = DEFAULT_SIZE_PER_SHARD,
        use_async: bool = False,
    ) -> None:
        """Save optimizer state keyed by parameter name (safetensors + JSON, no pickle)."""
        self.checkpoint_io.save_optimizer(
            optimizer.unwrap(), checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )

    def load_optimizer(
        self, optimizer: OptimizerWrapper, checkpoint: str | os.PathLike[str], prefix: str | None = None
    ) -> None:
        self.checkpoint_io.load_optimizer(optimizer.unwrap(), checkpoint, prefix)

    def save_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str | os.PathLike[str]) -> None:
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str | os.PathLike[str]) -> None:
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def synchronize(self) -> None:
        """Wait until every asynchronous save has reached disk (re-raising a writer's error)."""
        self.checkpoint_io.synchronize()
