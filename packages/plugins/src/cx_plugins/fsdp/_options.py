"""`FSDPOptions`: ColossalAI's TorchFSDPPlugin arguments (FSDP1's) validated once and translated into FSDP2's.

ColossalAI wraps the model in FSDP1 (`FullyShardedDataParallel`); cx runs torch's FSDP2 (`fully_shard`), which shards
each parameter as a DTensor and keeps the module's structure and parameter names. The FSDP1 vocabulary that scripts
pass stays accepted: a sharding strategy becomes `reshard_after_forward`, `MixedPrecision` becomes a
`MixedPrecisionPolicy`, `CPUOffload(offload_params=True)` a `CPUOffloadPolicy`, and the auto-wrap policy decides
which submodules get a `fully_shard` of their own. What FSDP2 cannot express raises here, naming the argument.
cx adds `use_fp8` (fp8 linears: torchao's on CUDA, the `fp8` extra, checked here) beside ColossalAI's
`fp8_communication`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)

from cx_mesh import get_accelerator
from cx_mesh.fp8 import ScalingRecipe
from cx_plugins.fp8._use_fp8 import check_fp8_recipe
from cx_plugins.fsdp._fp8 import TORCHAO, fp8_linears_for_device, require_torchao

__all__ = ["FSDPOptions"]


@dataclasses.dataclass(frozen=True)
class FSDPOptions:
    """What `fully_shard` is called with, and what the plugin does around it."""

    process_group: dist.ProcessGroup | None
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    buffer_dtype: torch.dtype | None
    offload_policy: OffloadPolicy
    wrap_policy: Callable[..., bool] | None
    ignored_modules: tuple[nn.Module, ...]
    sync_module_states: bool
    fp8_linears: str | None = None  # use_fp8: whose fp8 linears (fsdp/_fp8.py: TORCHAO or CX_MESH); None: off
    fp8_communication: bool = False
    fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE  # cx_mesh's linears; torchao's take TENSORWISE only

    @classmethod
    def from_colossalai(
        cls,
        process_group: dist.ProcessGroup | None,
        sharding_strategy: ShardingStrategy | None,
        cpu_offload: CPUOffload | None,
        auto_wrap_policy: Callable[..., bool] | None,
        backward_prefetch: BackwardPrefetch | None,
        mixed_precision: MixedPrecision | None,
        ignored_modules: Iterable[nn.Module] | None,
        param_init_fn: Callable[[nn.Module], None] | None,
        sync_module_states: bool,
        fp8_communication: bool,
        use_fp8: bool = False,
        fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    ) -> FSDPOptions:
        fp8_recipe = check_fp8_recipe("TorchFSDPPlugin", use_fp8, fp8_recipe)
        fp8_linears = fp8_linears_for_device() if use_fp8 else None
        if fp8_linears == TORCHAO:
            require_torchao()
            if fp8_recipe is not ScalingRecipe.TENSORWISE:
                raise NotImplementedError(
                    f"TorchFSDPPlugin(fp8_recipe={fp8_recipe.name}): on CUDA use_fp8 trains with torchao's float8 "
                    "linears, which cx configures with TENSORWISE scaling only; leave fp8_recipe at its default"
                )
        if param_init_fn is not None:
            raise NotImplementedError(
                "TorchFSDPPlugin(param_init_fn=...): FSDP1's deferred initialisation is not supported; build the "
                "model under cx_plugins.LazyInitContext instead (it is sharded before it is materialised)"
            )
        _check_prefetch(backward_prefetch)
        return cls(
            process_group=process_group,
            reshard_after_forward=_reshard_after_forward(sharding_strategy),
            mp_policy=_mp_policy(mixed_precision),
            buffer_dtype=None if mixed_precision is None else mixed_precision.buffer_dtype,
            offload_policy=_offload_policy(cpu_offload),
            wrap_policy=auto_wrap_policy,
            ignored_modules=tuple(ignored_modules or ()),
            sync_module_states=sync_module_states,
            fp8_linears=fp8_linears,
            fp8_communication=fp8_communication,
            fp8_recipe=fp8_recipe,
        )

    def fingerprint(self) -> object:
        """What every rank must agree on (callables and modules compared by kind)."""
        return (
            self.reshard_after_forward,
            repr(self.mp_policy),
            str(self.buffer_dtype),
            type(self.offload_policy).__name__,
            type(self.wrap_policy).__name__,
            len(self.ignored_modules),
            self.sync_module_states,
            self.fp8_linears,
            self.fp8_communication,
            self.fp8_recipe,
        )


def _reshard_after_forward(strategy: ShardingStrategy | None) -> bool:
    if strategy is None or strategy == ShardingStrategy.FULL_SHARD:
        return True
    if strategy == ShardingStrategy.SHARD_GRAD_OP:
        return False  # ZeRO-2: parameters stay gathered from forward to backward
    if strategy == ShardingStrategy.NO_SHARD:
        raise NotImplementedError(
            "TorchFSDPPlugin(sharding_strategy=NO_SHARD) is plain data parallelism: use TorchDDPPlugin"
        )
    raise NotImplementedError(
        f"TorchFSDPPlugin(sharding_strategy={strategy.name}): hybrid sharding is not supported yet; use FULL_SHARD "
        "or SHARD_GRAD_OP"
    )


def _mp_policy(mixed_precision: MixedPrecision | None) -> MixedPrecisionPolicy:
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if torch.float16 in (mixed_precision.param_dtype, mixed_precision.reduce_dtype):
        raise NotImplementedError(
            "TorchFSDPPlugin: float16 mixed precision needs loss scaling across shards, which cx does not provide "
            "for FSDP yet; use bfloat16 (MixedPrecision(param_dtype=torch.bfloat16, ...)) or LowLevelZeroPlugin/"
            "GeminiPlugin with precision='fp16'"
        )
    return MixedPrecisionPolicy(
        param_dtype=mixed_precision.param_dtype,
        reduce_dtype=mixed_precision.reduce_dtype,
        cast_forward_inputs=mixed_precision.cast_forward_inputs,
    )


def _offload_policy(cpu_offload: CPUOffload | None) -> OffloadPolicy:
    if cpu_offload is None or not cpu_offload.offload_params:
        return OffloadPolicy()
    return CPUOffloadPolicy(pin_memory=get_accelerator().is_pin_memory_available())


def _check_prefetch(backward_prefetch: BackwardPrefetch | None) -> None:
    """FSDP2 prefetches the next all-gather in backward as FSDP1's BACKWARD_PRE does; BACKWARD_POST is not offered."""
    if backward_prefetch == BackwardPrefetch.BACKWARD_POST:
        warnings.warn(
            "TorchFSDPPlugin(backward_prefetch=BACKWARD_POST): FSDP2 prefetches as BACKWARD_PRE does; using that",
            stacklevel=4,
        )
