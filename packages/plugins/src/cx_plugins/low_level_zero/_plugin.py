"""`LowLevelZeroPlugin`: ZeRO-1/2 (cx_zero.LowLevelZeroOptimizer) behind the Booster, arguments as in ColossalAI.

The plugin only composes: turn ColossalAI's flat arguments into cx-zero's option groups once, build the
(extra_dp, zero) layout, cast the model to the training precision, wrap the optimizer. The algorithm lives in
cx-zero. `use_fp8` swaps the model's eligible plain `nn.Linear` layers for `cx_mesh.fp8.Fp8Linear` before casting,
scaled as `fp8_recipe` says (cx's addition: TENSORWISE by default, ROWWISE, or BLOCKWISE's 1x128 / 128x128 tiles);
`fp8_communication` is the engine's own option (fp8 gradient reduce-scatter and parameter all-gather).
`optimizer_states_dtype="bf16"` keeps Adam's moments in bf16 with stochastic rounding (cx_zero.Bf16StateAdam).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import CheckpointIO
from cx_mesh import assert_same_across_ranks, get_accelerator
from cx_mesh.fp8 import Fp8Options, ScalingRecipe
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins._plugin import ZERO_PRECISIONS, Boosted, ZeroPluginBase
from cx_plugins._weak_lookup import WeakLookup
from cx_plugins.fp8._communication import warn_if_nothing_to_compress
from cx_plugins.fp8._use_fp8 import check_fp8_recipe, convert_linears_to_fp8
from cx_plugins.low_level_zero._checkpoint_io import ZeroCheckpointIO
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_plugins.wrappers._zero import CastModel, ZeroOptimizerWrapper
from cx_zero import (
    ClipOptions,
    LossScaleOptions,
    LowLevelZeroOptimizer,
    LowLevelZeroOptions,
    Precision,
    ZeroStage,
    parse_states_dtype,
)

__all__ = ["LowLevelZeroPlugin", "LowLevelZeroPluginOptions"]


@dataclass(frozen=True)
class LowLevelZeroPluginOptions:
    """The plugin's arguments as groups: the training precision, the engine's own `LowLevelZeroOptions` (taken
    whole by `LowLevelZeroOptimizer(options=...)`), and the layout."""

    precision: Precision
    zero: LowLevelZeroOptions
    cast_inputs: bool
    extra_dp_size: int
    use_fp8: bool = False
    fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE

    @property
    def stage(self) -> int:
        return self.zero.stage.value


class LowLevelZeroPlugin(ZeroPluginBase):
    """ZeRO stage 1 or 2: optimizer state and fp32 master weights (and stage-2 gradients) partitioned over ranks."""

    def __init__(
        self,
        stage: int = 1,
        precision: str = "fp16",
        initial_scale: float = 2**32,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        reduce_bucket_size_in_m: int = 12,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        overlap_allgather: bool = False,
        cpu_offload: bool = False,
        master_weights: bool = True,
        verbose: bool = False,
        cast_inputs: bool = True,
        fp8_communication: bool = False,
        use_fp8: bool = False,
        extra_dp_size: int = 1,
        optimizer_states_dtype: str | torch.dtype = "fp32",
        fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    ) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise ValueError(f"LowLevelZeroPlugin: stage must be 1 or 2, got {stage!r}")
        if not reduce_bucket_size_in_m > 0 or math.isinf(reduce_bucket_size_in_m):
            raise ValueError(f"reduce_bucket_size_in_m must be a positive number, got {reduce_bucket_size_in_m}")
        self.options = LowLevelZeroPluginOptions(
            precision=Precision.parse(precision, ZERO_PRECISIONS),
            zero=LowLevelZeroOptions(
                loss_scale=LossScaleOptions(
                    initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale
                ),
                clipping=ClipOptions.of(max_norm, norm_type, name="LowLevelZeroPlugin: max_norm"),
                verbose=verbose,
                reduce_bucket_size=int(reduce_bucket_size_in_m * 1024 * 1024),
                communication_dtype=communication_dtype,
                overlap_communication=overlap_communication,
                stage=ZeroStage(stage),
                cpu_offload=cpu_offload,
                master_weights=master_weights,
                overlap_allgather=overlap_allgather,
                fp8_communication=fp8_communication,
                optimizer_states_dtype=parse_states_dtype(optimizer_states_dtype, "LowLevelZeroPlugin"),
            ),
            cast_inputs=cast_inputs,
            extra_dp_size=extra_dp_size,
            use_fp8=use_fp8,
            fp8_recipe=check_fp8_recipe("LowLevelZeroPlugin", use_fp8, fp8_recipe),
        )
        assert_same_across_ranks(self.options, what="LowLevelZeroPlugin options")
        # ColossalAI's (extra_dp, zero) mesh: each zero group is a block of contiguous ranks
        self.layout = ParallelLayout.build(
            [(Axis.EXTRA_DP, extra_dp_size), (Axis.ZERO, FILL)], data_axes=(Axis.EXTRA_DP, Axis.ZERO)
        )
        warn_if_nothing_to_compress("LowLevelZeroPlugin", fp8_communication, self.layout.world_size)
        # Which ZeRO optimizer serves a user's torch optimizer, and which module each one trains (for checkpoint IO).
        self._zero_of: WeakLookup[Optimizer, LowLevelZeroOptimizer] = WeakLookup()
        self._owner_of: weakref.WeakKeyDictionary[LowLevelZeroOptimizer, weakref.ref[nn.Module]] = (
            weakref.WeakKeyDictionary()
        )

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
        o = self.options
        if not isinstance(model, ModelWrapper):
            if o.use_fp8:
                convert_linears_to_fp8(model, "LowLevelZeroPlugin", Fp8Options(recipe=o.fp8_recipe))
            model = CastModel(model.to(get_accelerator().current_device()), o.precision.dtype, o.cast_inputs)
        wrapped: OptimizerWrapper | None = None
        if optimizer is not None:
            zero = LowLevelZeroOptimizer(
                optimizer,
                dp_process_group=self.layout.group(Axis.ZERO),
                extra_dp_group=self.layout.group_or_none(Axis.EXTRA_DP),
                module=model.unwrap(),
                options=o.zero,
            )
            self._zero_of[optimizer] = zero
            self._owner_of[zero] = weakref.ref(model.unwrap())
            wrapped = ZeroOptimizerWrapper(optimizer, zero)
        return model, wrapped, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        return ZeroCheckpointIO(self._zero_of.get, self._optimizers_of)

    def _optimizers_of(self, module: nn.Module) -> Iterator[LowLevelZeroOptimizer]:
        return (zero for zero, owner in self._owner_of.items() if owner() is module)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients without communication (the next backward outside the block reduces them all)."""
        if not isinstance(optimizer, ZeroOptimizerWrapper):
            raise ValueError("LowLevelZeroPlugin.no_sync needs the optimizer returned by booster.boost")
        return optimizer.zero.no_sync()
