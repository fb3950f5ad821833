"""`TorchDDPPlugin`: PyTorch's DistributedDataParallel behind the Booster, arguments as in ColossalAI.

DDP communicates inside torch (its forward's buffer broadcast and bucket rebuild, its backward's gradient
all-reduce), so the boosted model and optimizer run those phases named (`_PHASES`): a stuck or killed peer gives a
`CollectiveTimeoutError` / `PeerFailedError` naming the phase, the default group and this rank."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import CheckpointIO, attach_param_names
from cx_mesh import assert_same_across_ranks, get_accelerator
from cx_plugins._plugin import Boosted, DPPluginBase
from cx_plugins.checkpoint_io._replicated import ReplicatedCheckpointIO
from cx_plugins.ddp._fp8_hook import register_fp8_comm_hook
from cx_plugins.fp8._communication import warn_if_nothing_to_compress
from cx_plugins.options._ddp import DDPOptions
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_plugins.wrappers._named_phases import NamedPhases
from cx_zero import Precision

__all__ = ["DDPOptions", "TorchDDPModel", "TorchDDPPlugin"]

_PHASES = NamedPhases(
    group=None,  # DistributedDataParallel without a process group: the default group
    forward="DDP forward (buffer broadcast, bucket rebuild)",
    backward="gradient all-reduce in DDP backward",
)  # the step is local: the gradients are already reduced


class TorchDDPModel(ModelWrapper):
    """A model wrapped in DistributedDataParallel; `unwrap()` returns the original module. With `fp8_communication`
    the gradient buckets are all-reduced in fp8 (E5M2) by a DDP comm hook."""

    def __init__(self, module: nn.Module, options: DDPOptions, fp8_communication: bool = False) -> None:
        device = get_accelerator().current_device()
        ddp = DistributedDataParallel(module.to(device), **options.ddp_kwargs(device))
        if fp8_communication:
            register_fp8_comm_hook(ddp)
        super().__init__(ddp, _PHASES)


class TorchDDPPlugin(DPPluginBase):
    """Plain data parallelism with PyTorch DDP. Mixed precision comes from the Booster ("fp16", "bf16");
    `fp8_communication=True` all-reduces the gradients in fp8 (E5M2, ColossalAI's fp8 DDP hook)."""

    def __init__(
        self,
        broadcast_buffers: bool = True,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        fp8_communication: bool = False,
    ) -> None:
        super().__init__()
        self.fp8_communication = fp8_communication
        self.options = DDPOptions(
            broadcast_buffers=broadcast_buffers,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            check_reduction=check_reduction,
            gradient_as_bucket_view=gradient_as_bucket_view,
            static_graph=static_graph,
        )
        assert_same_across_ranks((self.options, fp8_communication), what="TorchDDPPlugin options")
        warn_if_nothing_to_compress("TorchDDPPlugin", fp8_communication, dist.get_world_size())

    def supported_devices(self) -> list[str]:
        return ["cuda", "cpu"]

    def supported_precisions(self) -> list[str]:
        return [p.value for p in Precision]

    def control_precision(self) -> bool:
        return False

    def control_device(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return True

    def support_lora(self) -> bool:
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        if optimizer is not None and not isinstance(model, ModelWrapper):
            attach_param_names(optimizer, model)  # checkpoints key optimizer state by the user's parameter names
        boosted = (
            model if isinstance(model, ModelWrapper) else TorchDDPModel(model, self.options, self.fp8_communication)
        )
        wrapped = None if optimizer is None else OptimizerWrapper(optimizer, _PHASES)
        return boosted, wrapped, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        return ReplicatedCheckpointIO()

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no all-reduce) inside the block."""
        return _find_ddp(model).no_sync()


def _find_ddp(model: nn.Module) -> DistributedDataParallel:
    for module in model.modules():
        if isinstance(module, DistributedDataParallel):
            return module
    raise ValueError("no_sync: the model was not boosted by TorchDDPPlugin (no DistributedDataParallel inside)")
