"""The plugin interface (as in ColossalAI) and the data-parallel base that shards data by data-parallel rank."""

from __future__ import annotations

import contextlib
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from cx_checkpoint import CheckpointIO
from cx_mesh import require_initialized
from cx_plugins._layout import ParallelLayout
from cx_plugins._lora import apply_lora
from cx_plugins._precision import Precision
from cx_plugins.wrappers._base import OptimizerWrapper

__all__ = ["ZERO_PRECISIONS", "Boosted", "DPPluginBase", "Plugin", "ZeroPluginBase"]

ZERO_PRECISIONS = (Precision.FP16, Precision.BF16, Precision.FP32)
"""The training precisions the ZeRO plugins apply themselves (cx adds fp32 to ColossalAI's fp16 and bf16)."""

Boosted = tuple[
    nn.Module, OptimizerWrapper | None, Callable[..., Any] | None, DataLoader[Any] | None, LRScheduler | None
]


class Plugin(ABC):
    """What a Booster needs from a parallel strategy."""

    @abstractmethod
    def supported_devices(self) -> list[str]: ...

    @abstractmethod
    def supported_precisions(self) -> list[str]: ...

    @abstractmethod
    def control_precision(self) -> bool:
        """True when the plugin applies mixed precision itself (the Booster's `mixed_precision` must be None)."""

    @abstractmethod
    def control_device(self) -> bool: ...

    @abstractmethod
    def support_no_sync(self) -> bool: ...

    @abstractmethod
    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted: ...

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation without communication; plugins that support it override this."""
        raise NotImplementedError(f"{type(self).__name__} does not support no_sync")

    def supports_pipeline(self) -> bool:
        return False

    def materialises_lazy_models(self) -> bool:
        """Whether `configure` takes a model built under `LazyInitContext` as it is and materialises it straight
        into its shards; otherwise the Booster materialises it in full first (ranks that hold every parameter in
        full need the whole model anyway)."""
        return False

    def support_lora(self) -> bool:
        """Whether `enable_lora` works with this plugin (and `save_lora_as_pretrained` gathers its adapters)."""
        return False

    def enable_lora(self, model: nn.Module, pretrained_dir: str | None = None, lora_config: Any = None) -> nn.Module:
        """Add LoRA adapters (peft) to `model` before boost; a clear error for plugins that do not support it."""
        if not self.support_lora():
            raise NotImplementedError(
                f"{type(self).__name__} does not support LoRA yet; use TorchDDPPlugin, LowLevelZeroPlugin or "
                "HybridParallelPlugin for LoRA fine-tuning"
            )
        return apply_lora(model, pretrained_dir, lora_config)

    @abstractmethod
    def get_checkpoint_io(self) -> CheckpointIO:
        """The plugin's checkpoint IO; every plugin writes the canonical cx format."""

    @abstractmethod
    def prepare_dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: type[DistributedSampler[Any]] | None = None,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader that gives each data-parallel rank its own share of `dataset`."""


class DPPluginBase(Plugin):
    """Base for data-parallel plugins: knows the data-parallel rank and size, and shards data by them."""

    def __init__(self) -> None:
        require_initialized(type(self).__name__)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        """(rank, size) along the data-parallel dimension; plugins with model parallelism override it."""
        return self.rank, self.world_size

    def prepare_dataloader(
        self,
        dataset: Dataset[Any],
        batch_size: int,
        shuffle: bool = False,
        seed: int = 1024,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        distributed_sampler_cls: type[DistributedSampler[Any]] | None = None,
        **kwargs: Any,
    ) -> DataLoader[Any]:
        """A DataLoader whose sampler gives each data-parallel rank a disjoint, deterministic share of `dataset`.

        Ranks that differ only in model-parallel coordinates get the same data. Workers are seeded from `seed`, the
        data-parallel rank and the worker id, so every worker draws differently and every run repeats.
        """
        dp_rank, dp_size = self.data_parallel_rank_and_size()
        sampler_cls = distributed_sampler_cls or DistributedSampler
        sampler = sampler_cls(
            dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        generator = torch.Generator().manual_seed(seed + dp_rank)
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            worker_init_fn=_WorkerSeeder(seed, dp_rank),
            generator=generator,
            drop_last=drop_last,
            pin_memory=pin_memory,
            num_workers=num_workers,
            **kwargs,
        )


class ZeroPluginBase(DPPluginBase):
    """Shared by the ZeRO plugins: they own precision and device placement, and their `ParallelLayout` (built by the
    subclass as `self.layout`) gives the data-parallel coordinates."""

    layout: ParallelLayout

    def supported_devices(self) -> list[str]:
        return ["cuda", "cpu"]

    def supported_precisions(self) -> list[str]:
        return [p.value for p in ZERO_PRECISIONS]

    def control_precision(self) -> bool:
        return True

    def control_device(self) -> bool:
        return True

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        return self.layout.data_rank_and_size()


class _WorkerSeeder:
    """Picklable worker_init_fn: seeds Python and torch in each DataLoader worker."""

    def __init__(self, seed: int, dp_rank: int) -> None:
        self.seed = seed
        self.dp_rank = dp_rank

    def __call__(self, worker_id: int) -> None:
        worker_seed = (self.seed * 1_000_003 + self.dp_rank * 1_009 + worker_id) % 2**32
        random.seed(worker_seed)
        torch.manual_seed(worker_seed)
