"""`TorchFSDPPlugin`: ColossalAI's FSDP plugin arguments, run on torch's FSDP2 (`fully_shard`).

Composition: validate the FSDP1-style arguments into `FSDPOptions`, optionally sync rank 0's weights, shard the
submodules the wrap policy picks and then the root, and repoint the user's optimizer at the sharded parameters
(its param groups kept). Checkpoints are the canonical cx format (`FSDPCheckpointIO`). FSDP2 communicates inside
torch (hooks around forward and backward; DTensor maths in clipping): those phases run named (`_phases`), so a
stuck or killed peer gives a `CollectiveTimeoutError` / `PeerFailedError` naming the phase, the group and this rank.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    FSDPModule,
    MixedPrecision,
    ShardingStrategy,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import CheckpointIO
from cx_mesh import assert_same_across_ranks, get_accelerator
from cx_mesh.fp8 import ScalingRecipe
from cx_plugins._plugin import Boosted, DPPluginBase
from cx_plugins.fp8._communication import warn_if_nothing_to_compress
from cx_plugins.fsdp._checkpoint_io import FSDPCheckpointIO
from cx_plugins.fsdp._muon import ShardedMuon, sharded_muon_supported
from cx_plugins.fsdp._muon_adamw import ShardedMuonWithAdamW, muon_adamw_supported
from cx_plugins.fsdp._options import FSDPOptions
from cx_plugins.fsdp._wrap import cast_buffers, repoint_optimizer, shard_module, sync_module_states
from cx_plugins.lazy._context import LazyModel, is_lazy
from cx_plugins.lazy._fsdp import materialise_into_fsdp_shards
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_plugins.wrappers._named_phases import NamedPhases
from cx_zero import MuonWithAdamW, needs_whole_tensors, require_elementwise

__all__ = ["FSDPOptimizerWrapper", "TorchFSDPModel", "TorchFSDPPlugin"]

_CLIPPING = "gradient-norm all-reduce in FSDP clipping"


def _phases(group: dist.ProcessGroup | None) -> NamedPhases:
    """FSDP2's communication over `group`: parameters gathered in forward (and again in backward when resharded),
    gradients reduce-scattered in backward. The step is local to each shard."""
    return NamedPhases(
        group=group,
        forward="parameter all-gather in FSDP forward",
        backward="parameter all-gather and gradient reduce-scatter in FSDP backward",
    )


class TorchFSDPModel(ModelWrapper):
    """A model sharded with FSDP2 in place; `unwrap()` is the user's module (its parameters are now DTensors)."""


class FSDPOptimizerWrapper(OptimizerWrapper):
    """The user's optimizer over the sharded parameters; clipping returns the global norm as a plain tensor. torch's
    Muon and cx-zero's MuonWithAdamW step through `ShardedMuon` (Newton-Schulz on whole matrices at owner ranks, the
    rest, AdamW's groups included, on the shards)."""

    def __init__(self, optimizer: Optimizer, phases: NamedPhases, muon: ShardedMuon | None = None) -> None:
        super().__init__(optimizer, phases)
        self._muon = muon

    def step(self, closure: Callable[[], float] | None = None) -> None:
        with self._muon.patched() if self._muon is not None else contextlib.nullcontext():
            super().step(closure)

    def clip_grad_by_norm(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        with self.phases.during(_CLIPPING):
            norm = super().clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)  # DTensor maths: global norm
            return norm.full_tensor() if isinstance(norm, DTensor) else norm


class TorchFSDPPlugin(DPPluginBase):
    """Fully sharded data parallelism with torch's FSDP2, arguments as ColossalAI's TorchFSDPPlugin (FSDP1's).

    `use_fp8=True` (cx's addition) trains the eligible linears with fp8 matmuls (torchao's on CUDA: the `fp8` extra);
    `fp8_communication=True` sends the gradient reduce-scatter and the parameter all-gather in fp8 (fsdp/_fp8.py)."""

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Callable[..., bool] | None = None,
        backward_prefetch: BackwardPrefetch | None = None,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool = False,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    ) -> None:
        super().__init__()
        self.options = FSDPOptions.from_colossalai(
            process_group,
            sharding_strategy,
            cpu_offload,
            auto_wrap_policy,
            backward_prefetch,
            mixed_precision,
            ignored_modules,
            param_init_fn,
            sync_module_states,
            fp8_communication,
            use_fp8,
            fp8_recipe,
        )
        assert_same_across_ranks(self.options.fingerprint(), what="TorchFSDPPlugin options")
        warn_if_nothing_to_compress("TorchFSDPPlugin", fp8_communication, dist.get_world_size(process_group))
        self._owner: weakref.WeakKeyDictionary[Optimizer, nn.Module] = weakref.WeakKeyDictionary()
        self._muon: weakref.WeakKeyDictionary[Optimizer, ShardedMuon] = weakref.WeakKeyDictionary()

    def supported_devices(self) -> list[str]:
        return ["cuda", "cpu"]

    def supported_precisions(self) -> list[str]:
        return ["fp32"]  # precision comes from the FSDP `mixed_precision` argument, as in ColossalAI

    def control_precision(self) -> bool:
        return True

    def control_device(self) -> bool:
        return True

    def support_no_sync(self) -> bool:
        return True

    def materialises_lazy_models(self) -> bool:
        """A lazily built model is sharded on the meta device and each parameter cut into this rank's shard."""
        return True

    def data_parallel_rank_and_size(self) -> tuple[int, int]:
        group = self.options.process_group
        return (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (self.rank, self.world_size)

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        if optimizer is not None:  # FSDP2 hands the optimizer row shards: elementwise, or Muon (_muon*.py)
            _require_supported(optimizer, type(self).__name__)
        if not isinstance(model, ModelWrapper):
            names = {parameter: name for name, parameter in model.named_parameters()}
            device = get_accelerator().current_device()
            if is_lazy(model):  # sharded on the meta device, then each parameter cut into this rank's shard
                lazy = LazyModel(model)
                shard_module(model, self.options)
                sync = self.options.process_group if self.options.sync_module_states else False
                materialise_into_fsdp_shards(model, lazy, names, torch.device(device), sync)
                cast_buffers(model, self.options.buffer_dtype)
            else:
                model = model.to(device)
                if self.options.sync_module_states:
                    sync_module_states(model, self.options.process_group)
                cast_buffers(model, self.options.buffer_dtype)
                shard_module(model, self.options)
            if optimizer is not None:
                repoint_optimizer(optimizer, names, model)
            model = TorchFSDPModel(model, _phases(self.options.process_group))
        wrapped = None
        if optimizer is not None:
            self._owner[optimizer] = model.unwrap()
            muon = _sharded_muon(optimizer, self.options.process_group)
            if muon is not None:
                self._muon[optimizer] = muon
            wrapped = FSDPOptimizerWrapper(optimizer, _phases(self.options.process_group), muon)
        return model, wrapped, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        return FSDPCheckpointIO(self._owner, self._muon)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without reduce-scatter inside the block (FSDP2's `set_requires_gradient_sync`)."""
        return _gradient_sync_off(model.unwrap() if isinstance(model, ModelWrapper) else model)


def _require_supported(optimizer: Optimizer, who: str) -> None:
    """An elementwise optimizer steps on the shards as is; torch's Muon and cx-zero's MuonWithAdamW through
    `ShardedMuon`; any other optimizer that needs whole tensors is refused (the plugin knows how to split only those
    two steps)."""
    if needs_whole_tensors(optimizer) and not (sharded_muon_supported(optimizer) or muon_adamw_supported(optimizer)):
        raise TypeError(
            f"{who}: {type(optimizer).__name__} needs each parameter whole, and {who} steps on parameter shards; "
            f"it steps torch.optim.Muon and cx_zero.MuonWithAdamW themselves (Newton-Schulz on whole matrices), not "
            f"subclasses or other whole-tensor optimizers (docs/plugins.md, 'Matrix-wise optimizers')"
        )
    if not needs_whole_tensors(optimizer):
        require_elementwise(optimizer, who)


def _sharded_muon(optimizer: Optimizer, group: dist.ProcessGroup | None) -> ShardedMuon | None:
    """The sharded step of a whole-tensor optimizer `_require_supported` let through (None: elementwise)."""
    if not needs_whole_tensors(optimizer):
        return None
    return (ShardedMuonWithAdamW if type(optimizer) is MuonWithAdamW else ShardedMuon)(optimizer, group)


@contextlib.contextmanager
def _gradient_sync_off(module: nn.Module) -> Iterator[None]:
    if not isinstance(module, FSDPModule):
        raise ValueError("no_sync: the model was not boosted by TorchFSDPPlugin")
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
