"""`Booster`: the user's entry point. It validates the plugin/precision pairing, asks the plugin to configure the
training objects, and routes backward, no_sync and checkpointing through the plugin.

It also refuses what would otherwise go wrong quietly: boosting a module or optimizer a second time, `backward`
with an optimizer that was never boosted, and (in bf16, which has no loss scaling to skip a bad step) a NaN or
infinite loss, which would turn every parameter into NaN: `backward` stops with an error naming the step and ranks
(read on the first calls, then every `finite_loss_check_every` calls and before a save: `_finite_loss`).
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import DEFAULT_SIZE_PER_SHARD, CheckpointIO, LoadResult
from cx_mesh import get_accelerator
from cx_plugins._finite_loss import FINITE_LOSS_CHECK_EVERY, FiniteLossWatch
from cx_plugins._flash_packing import refuse_flash_packing
from cx_plugins._no_cache import forward_without_cache
from cx_plugins._plugin import Boosted, Plugin
from cx_plugins._precision import AutocastModel, Precision, ScaledOptimizer
from cx_plugins.checkpoint_io._capabilities import KeepsLossScaler, SavesLora
from cx_plugins.lazy._context import is_lazy, materialize
from cx_plugins.options._settings import check_boost_settings
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper

__all__ = ["Booster"]

_BOOSTED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_BOOSTED_OPTIMIZERS: weakref.WeakSet[Optimizer] = weakref.WeakSet()


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
        self._finite_loss: weakref.WeakKeyDictionary[OptimizerWrapper, FiniteLossWatch] = weakref.WeakKeyDictionary()
        #: bf16: after the first backward calls, every how many the non-finite-loss record is read (docs/plugins.md)
        self.finite_loss_check_every = FINITE_LOSS_CHECK_EVERY
        self._steps: weakref.WeakKeyDictionary[Optimizer, int] = weakref.WeakKeyDictionary()

    @property
    def training_precision(self) -> Precision:
        """The precision the forward runs in: the plugin's own (ZeRO plugins) or the Booster's `mixed_precision`."""
        if self.plugin.control_precision():
            options = getattr(self.plugin, "options", None)
            precision = getattr(options, "precision", None)
            return precision if isinstance(precision, Precision) else Precision.FP32
        return self.mixed_precision

    def boost(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        """Returns (model, optimizer, criterion, dataloader, lr_scheduler), each ready for distributed training."""
        _refuse_boosted(model, optimizer)
        check_boost_settings(self.plugin, self.mixed_precision.value, optimizer)
        if not isinstance(model, ModelWrapper):
            forward_without_cache(model)  # transformers skips packed-document masks when it builds a cache
            refuse_flash_packing(model)  # and its flash attention sees packed documents only in one row
        if is_lazy(model) and not self.plugin.materialises_lazy_models():
            materialize(model)  # built under LazyInitContext: real values now, before the plugin places or shards them
        boosted_model, boosted_optimizer, criterion, dataloader, lr_scheduler = self.plugin.configure(
            model, optimizer, criterion, dataloader, lr_scheduler
        )
        if not isinstance(model, ModelWrapper):
            _BOOSTED_MODULES.add(model)
        if optimizer is not None:
            _BOOSTED_OPTIMIZERS.add(optimizer)
            if self.training_precision is Precision.BF16:
                self._count_steps(optimizer)
        if self.mixed_precision is not Precision.FP32 and not isinstance(boosted_model, AutocastModel):
            boosted_model = AutocastModel(boosted_model, self.mixed_precision)
            if self.mixed_precision is Precision.FP16 and boosted_optimizer is not None:
                scaled = ScaledOptimizer(boosted_optimizer.unwrap(), boosted_optimizer.phases)  # DDP's names kept
                boosted_optimizer = scaled
                io = self.checkpoint_io
                if isinstance(io, KeepsLossScaler):  # checkpoints keep the loss scale
                    io.register_loss_scaler(scaled.unwrap(), scaled.scaler)
        return boosted_model, boosted_optimizer, criterion, dataloader, lr_scheduler

    def backward(self, loss: torch.Tensor, optimizer: OptimizerWrapper) -> None:
        """Backward through the optimizer wrapper, so loss scaling and gradient reduction happen where they must.

        In bf16 a NaN or infinite loss on any rank stops every rank with a `FloatingPointError` naming the step and
        the ranks: before its backward on the first calls, else at the next check (every `finite_loss_check_every`
        calls and before a save); in between nothing is read on the host (`_finite_loss`)."""
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError(
                f"booster.backward(loss, optimizer) needs the optimizer booster.boost returned, got a "
                f"{type(optimizer).__module__}.{type(optimizer).__qualname__}: call "
                "`model, optimizer, *_ = booster.boost(model, optimizer)` first and use what it returns"
            )
        if self.training_precision is Precision.BF16:
            watch = self._finite_loss.setdefault(optimizer, FiniteLossWatch())
            watch.record(loss, self._steps.get(optimizer.unwrap(), 0) + 1, self.finite_loss_check_every)
        optimizer.backward(loss)

    def _count_steps(self, optimizer: Optimizer) -> None:
        self._steps[optimizer] = 0

        def count(opt: Optimizer, args: Any, kwargs: Any) -> None:
            self._steps[opt] = self._steps.get(opt, 0) + 1

        optimizer.register_step_post_hook(count)

    def _check_losses_before_saving(self) -> None:
        """bf16: a checkpoint is never written from parameters a non-finite loss may have spoilt (`_finite_loss`)."""
        for watch in list(self._finite_loss.values()):
            watch.check("before saving a checkpoint")

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation without communication, where the plugin supports it (else the plugin says why)."""
        return self.plugin.no_sync(model, optimizer)

    def execute_pipeline(
        self,
        data_iter: Any,
        model: nn.Module,
        criterion: Callable[[Any, Any], torch.Tensor] | None,
        optimizer: OptimizerWrapper | None = None,
        return_loss: bool = True,
        return_outputs: bool = False,
    ) -> dict[str, Any]:
        """One pipeline step (every micro-batch's forward and backward) over the next batch of `data_iter`:
        {"loss": mean over micro-batches on the rank holding the last stage (None elsewhere), "outputs": ...}.
        Then `optimizer.step()` as usual. Only plugins with pipeline parallelism run it."""
        run = getattr(self.plugin, "execute_pipeline", None)
        if not self.plugin.supports_pipeline() or run is None:
            raise NotImplementedError(
                f"execute_pipeline needs a plugin with pipeline parallelism; {type(self.plugin).__name__} has none "
                "here (HybridParallelPlugin with pp_size > 1 has): call model(...) and booster.backward instead"
            )
        result: dict[str, Any] = run(data_iter, model, criterion, optimizer, return_loss, return_outputs)
        return result

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
            raise NotImplementedError(
                "enable_lora: quantised base weights (bitsandbytes) are not supported in cx; train LoRA on bf16 base "
                "weights (precision='bf16')"
            )
        if isinstance(model, ModelWrapper):
            raise ValueError("enable_lora must be called before boost (this model is already boosted)")
        return self.plugin.enable_lora(model, None if pretrained_dir is None else str(pretrained_dir), lora_config)

    def save_lora_as_pretrained(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], use_safetensors: bool = False
    ) -> None:
        """Save the LoRA adapters of a boosted model in peft's format (loadable by `PeftModel.from_pretrained` and by
        `enable_lora(pretrained_dir=...)`); always safetensors."""
        io = self.checkpoint_io
        if not isinstance(io, SavesLora) or not self.plugin.support_lora():
            raise NotImplementedError(
                f"save_lora_as_pretrained: {type(self.plugin).__name__} does not support LoRA; TorchDDPPlugin, "
                "LowLevelZeroPlugin, GeminiPlugin and HybridParallelPlugin do"
            )
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
        self._check_losses_before_saving()
        self.checkpoint_io.save_model(
            model, checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async
        )

    def load_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
        *,
        verify: bool = False,
    ) -> LoadResult:
        """Load a cx/HF checkpoint into `model`; with `strict`, missing or unexpected keys are errors.

        `low_cpu_mem_mode` and `num_threads` are ColossalAI's and accepted: cx always loads tensor by tensor from a
        memory map (low memory), in the calling thread.

        With `strict=False` the keys skipped either way are returned (`LoadResult`) and reported in a warning.
        `verify=True` first checks every file against the checksum recorded at save."""
        result = self.checkpoint_io.load_model(model, checkpoint, strict=strict, verify=verify)
        if result.missing_keys or result.unexpected_keys:
            warnings.warn(
                f"load_model({checkpoint}, strict=False): {len(result.missing_keys)} key(s) of the model were not in "
                f"the checkpoint (left as they were): {_shorten(result.missing_keys)}; "
                f"{len(result.unexpected_keys)} key(s) of the checkpoint were not in the model (ignored): "
                f"{_shorten(result.unexpected_keys)}",
                stacklevel=2,
            )
        return result

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
        self._check_losses_before_saving()
        self.checkpoint_io.save_optimizer(
            optimizer.unwrap(), checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )

    def load_optimizer(
        self,
        optimizer: OptimizerWrapper,
        checkpoint: str | os.PathLike[str],
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
        *,
        verify: bool = False,
    ) -> None:
        """Load optimizer state; `verify=True` first checks every file against the checksum recorded at save.

        Positional arguments follow ColossalAI's order (`prefix`, `low_cpu_mem_mode`, `num_threads`); the last two
        are accepted and change nothing (see `load_model`)."""
        self.checkpoint_io.load_optimizer(optimizer.unwrap(), checkpoint, prefix, verify=verify)

    def save_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str | os.PathLike[str]) -> None:
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: LRScheduler, checkpoint: str | os.PathLike[str]) -> None:
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)

    def synchronize(self) -> None:
        """Wait until every asynchronous save has reached disk (re-raising a writer's error)."""
        self.checkpoint_io.synchronize()


def _shorten(names: tuple[str, ...], shown: int = 10) -> str:
    text = ", ".join(names[:shown])
    return text + (f", ... ({len(names) - shown} more)" if len(names) > shown else "") if names else "none"


def _refuse_boosted(model: nn.Module, optimizer: Optimizer | None) -> None:
    """Boosting twice wraps twice (or fails deep inside a plugin): say what happened instead."""
    if isinstance(optimizer, OptimizerWrapper):
        raise ValueError(
            "booster.boost: the optimizer is already boosted (it is one booster.boost returned); boost the original "
            "torch optimizer once and keep using the boosted one it returns"
        )
    if optimizer is not None and optimizer in _BOOSTED_OPTIMIZERS:
        raise ValueError(
            f"booster.boost: this {type(optimizer).__name__} was already boosted; a torch optimizer can be boosted "
            "once: use the optimizer that first booster.boost call returned"
        )
    if not isinstance(model, ModelWrapper) and model in _BOOSTED_MODULES:
        raise ValueError(
            f"booster.boost: this {type(model).__name__} was already boosted (plugins wrap or shard it in place); "
            "use the model booster.boost returned, or build a new module to boost it again"
        )
