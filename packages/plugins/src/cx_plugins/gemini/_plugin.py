"""`GeminiPlugin`: chunk-based ZeRO-3 (cx_zero.GeminiDDP + GeminiOptimizer) behind the Booster.

Every constructor argument of ColossalAI's GeminiPlugin is accepted and honoured. `use_fp8` swaps the model's eligible
plain `nn.Linear` layers for `cx_mesh.fp8.Fp8Linear` before chunking (after ShardFormer with tp_size > 1);
`fp8_communication` is GeminiDDP's own option (fp8 chunk all-gather and gradient reduce-scatter); with tp_size > 1
both also go to ShardFormer's ShardConfig (the TP layers' matmuls and collectives). With `tp_size > 1` the mesh is
(zero, extra_dp, tp): ShardFormer splits the model over the tp group first (the enable_* switches honoured), then
Gemini shards it over the zero group; clipping takes the global norm over both, and checkpoints gather the TP shards
into the canonical format. The ShardFormer switches only act with tensor parallelism, in ColossalAI too: with
`tp_size=1` they are accepted with one warning naming them (ColossalAI's own examples pass
`enable_fused_normalization=True`), and have no effect. Unlike ColossalAI, `enable_async_reduce` does not quietly turn
`pin_memory` on, and `precision` also accepts "fp32". A whole-tensor optimizer (torch's Muon, MuonWithAdamW) at
`tp_size > 1` steps each matrix whole: Gemini gathers its chunk slices to a dp owner, whose tp group gathers the tp
slices to a tp owner (`_tp_whole`); with optimizer data on the CPU (`auto` placement, `offload_optim_frac > 0`) the
masters and the state stay there and only the tp collectives run on the communication device.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import DataLoader

from cx_checkpoint import CheckpointIO
from cx_chunk import MemStats
from cx_mesh import assert_same_across_ranks, get_accelerator
from cx_mesh.fp8 import Fp8Options, ScalingRecipe
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins._plugin import ZERO_PRECISIONS, Boosted, ZeroPluginBase
from cx_plugins._weak_lookup import WeakLookup
from cx_plugins.fp8._communication import warn_if_nothing_to_compress
from cx_plugins.fp8._use_fp8 import check_fp8_recipe, convert_linears_to_fp8
from cx_plugins.gemini._checkpoint_io import GeminiCheckpointIO
from cx_plugins.gemini._tp import shard_for_gemini, tp_split_names
from cx_plugins.gemini._tp_checkpoint_io import GeminiTPCheckpointIO
from cx_plugins.gemini._tp_whole import GeminiTensorParallelWhole
from cx_plugins.lazy._context import LazyModel, is_lazy
from cx_plugins.lazy._tp import SlicedSource
from cx_plugins.options._shardformer import ShardFormerOptions
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_plugins.wrappers._engine_optimizer import EngineOptimizer
from cx_zero import (
    ClipOptions,
    GeminiDDP,
    GeminiOptimizer,
    GeminiOptimizerOptions,
    GeminiOptions,
    LossScaleOptions,
    Precision,
    parse_states_dtype,
)

__all__ = ["GeminiPlugin"]

# ShardFormer switches: ColossalAI's GeminiPlugin runs ShardFormer only when tp_size > 1, so with tp_size=1 they do
# nothing there either
_SHARDFORMER_SWITCHES = (
    "enable_all_optimization",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_sequence_parallelism",
    "enable_jit_fused",
    "enable_sequence_overlap",
)


@dataclass(frozen=True)
class GeminiPluginOptions:
    """The plugin's arguments as groups: cx-zero's `GeminiOptions` and `GeminiOptimizerOptions` (taken whole by
    `GeminiDDP(options=...)` / `GeminiOptimizer(options=...)`), the layout, and what is per-rank data."""

    ddp: GeminiOptions
    optimizer: GeminiOptimizerOptions
    extra_dp_size: int
    precision: Precision
    verbose: bool
    memstats: MemStats | None = field(default=None, compare=False)
    use_fp8: bool = False
    fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE

    def fingerprint(self) -> object:
        """What all ranks must agree on: the MemStats object itself is per-rank data (compared by presence), and
        `chunk_init_device` by kind (each rank names its own accelerator, cuda:0, cuda:1, ...)."""
        device = self.ddp.chunk_init_device
        ddp = replace(self.ddp, chunk_init_device=None if device is None else torch.device(device.type))
        return (replace(self, ddp=ddp, memstats=None), self.memstats is not None)


class GeminiModel(ModelWrapper):
    """The boosted model: GeminiDDP inside; `unwrap()` is the user's module (its parameters stay sharded)."""

    def __init__(self, ddp: GeminiDDP) -> None:
        super().__init__(ddp)
        self.ddp = ddp

    def unwrap(self) -> nn.Module:
        return self.ddp.unwrap()

    def state_dict(  # type: ignore[override]
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False, *, only_rank_0: bool = True
    ) -> dict[str, torch.Tensor]:
        """Full tensors by the user's names, gathered (collective): ColossalAI's `model.state_dict(only_rank_0=...)`;
        with `only_rank_0=True` ranks other than 0 get an empty dict."""
        return self.ddp.state_dict(destination, prefix, keep_vars, only_rank_0=only_rank_0)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Full tensors by the user's names; each rank keeps its own part (every rank passes the full dict)."""
        return self.ddp.load_state_dict(state_dict, strict=strict, assign=assign)


class GeminiOptimizerWrapper(EngineOptimizer):
    """The boosted optimizer over a `GeminiOptimizer` (the engine, also `.gemini`)."""

    def __init__(self, optimizer: Optimizer, gemini: GeminiOptimizer) -> None:
        super().__init__(optimizer, gemini)
        self.gemini = gemini


class GeminiPlugin(ZeroPluginBase):
    """Gemini ZeRO-3: parameters, gradients and optimizer state in chunks sharded over ranks, placed on GPU or CPU."""

    def __init__(
        self,
        chunk_config_dict: dict[Any, Any] | None = None,
        chunk_init_device: torch.device | None = None,
        placement_policy: str = "static",
        enable_gradient_accumulation: bool = False,
        max_prefetch: int = 0,
        shard_param_frac: float = 1.0,
        offload_optim_frac: float = 0.0,
        offload_param_frac: float = 0.0,
        warmup_non_model_data_ratio: float = 0.8,
        steady_cuda_cap_ratio: float = 0.9,
        precision: str = "fp16",
        master_weights: bool = True,
        pin_memory: bool = False,
        force_outputs_fp32: bool = False,
        strict_ddp_mode: bool = False,
        search_range_m: int = 32,
        hidden_dim: int | None = None,
        min_chunk_size_m: float = 32,
        memstats: MemStats | None = None,
        gpu_margin_mem_ratio: float = 0.0,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0.0,
        norm_type: float = 2.0,
        tp_size: int = 1,
        extra_dp_size: int = 1,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_sequence_parallelism: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_overlap: bool = False,
        enable_async_reduce: bool = True,
        use_fp8: bool = False,
        verbose: bool = False,
        fp8_communication: bool = False,
        optimizer_states_dtype: str | torch.dtype = "fp32",
        fp8_recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    ) -> None:
        super().__init__()
        fp8_recipe = check_fp8_recipe("GeminiPlugin", use_fp8, fp8_recipe)
        switches = dict(
            zip(
                _SHARDFORMER_SWITCHES,
                (
                    enable_all_optimization,
                    enable_fused_normalization,
                    enable_flash_attention,
                    enable_sequence_parallelism,
                    enable_jit_fused,
                    enable_sequence_overlap,
                ),
                strict=True,
            )
        )
        on = [name for name, value in switches.items() if value]
        if on and tp_size == 1:
            warnings.warn(
                f"GeminiPlugin: {', '.join(f'{name}=True' for name in on)} ignored: ShardFormer optimizations apply "
                "only with tensor parallelism (tp_size > 1), in ColossalAI too, and tp_size=1 here",
                UserWarning,
                stacklevel=2,
            )
        resolved = Precision.parse(precision, ZERO_PRECISIONS)
        self.options = GeminiPluginOptions(
            ddp=GeminiOptions.from_arguments(
                chunk_config_dict=chunk_config_dict,
                chunk_init_device=chunk_init_device,
                placement_policy=placement_policy,
                enable_gradient_accumulation=enable_gradient_accumulation,
                max_prefetch=max_prefetch,
                shard_param_frac=shard_param_frac,
                offload_optim_frac=offload_optim_frac,
                offload_param_frac=offload_param_frac,
                warmup_non_model_data_ratio=warmup_non_model_data_ratio,
                steady_cuda_cap_ratio=steady_cuda_cap_ratio,
                search_range_m=search_range_m,
                hidden_dim=hidden_dim,
                min_chunk_size_m=min_chunk_size_m,
                pin_memory=pin_memory,
                force_outputs_fp32=force_outputs_fp32,
                strict_ddp_mode=strict_ddp_mode,
                mixed_precision=resolved.dtype,
                master_weights=master_weights,
                enable_async_reduce=enable_async_reduce,
                fp8_communication=fp8_communication,
            ),
            optimizer=GeminiOptimizerOptions(
                LossScaleOptions(
                    initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale
                ),
                ClipOptions.of(max_norm, norm_type, name="GeminiPlugin: max_norm"),
                gpu_margin_mem_ratio,
                optimizer_states_dtype=parse_states_dtype(optimizer_states_dtype, "GeminiPlugin"),
            ),
            extra_dp_size=extra_dp_size,
            precision=resolved,
            verbose=verbose,
            memstats=memstats,
            use_fp8=use_fp8,
            fp8_recipe=fp8_recipe,
        )
        # ShardFormer runs only with tensor parallelism (ColossalAI: sequence parallelism off at tp_size 1)
        self.shardformer = (
            ShardFormerOptions(
                enable_all_optimization=enable_all_optimization,
                enable_fused_normalization=enable_fused_normalization,
                enable_flash_attention=enable_flash_attention,
                enable_sequence_parallelism=enable_sequence_parallelism,
                enable_jit_fused=enable_jit_fused,
                enable_sequence_overlap=enable_sequence_overlap,
                use_fp8=use_fp8,
                fp8_communication=fp8_communication,
                fp8_recipe=fp8_recipe,
            )
            if tp_size > 1
            else None
        )
        assert_same_across_ranks((self.options.fingerprint(), tp_size, self.shardformer), what="GeminiPlugin options")
        # ColossalAI's (zero, extra_dp, tp) mesh: zero groups strided across the world
        self.layout = ParallelLayout.build(
            [(Axis.ZERO, FILL), (Axis.EXTRA_DP, extra_dp_size), (Axis.TP, tp_size)],
            data_axes=(Axis.ZERO, Axis.EXTRA_DP),
        )
        warn_if_nothing_to_compress("GeminiPlugin", fp8_communication, self.layout.world_size)
        self._gemini_of: WeakLookup[Optimizer, GeminiOptimizer] = WeakLookup()

    def support_no_sync(self) -> bool:
        return False

    def support_lora(self) -> bool:
        """LoRA: the frozen base weights go to chunks of their own (no gradients, master weights or optimizer
        state), the adapters to trained chunks; with tp_size > 1 ShardFormer shards the adapters with their base."""
        return True

    def materialises_lazy_models(self) -> bool:
        """A lazily built model goes straight into the chunks, parameter by parameter (with tp_size > 1 ShardFormer
        shards it on the meta device first and each value is cut to this rank's slice before it is chunked)."""
        return True

    def configure(
        self,
        model: nn.Module,
        optimizer: Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: DataLoader[Any] | None = None,
        lr_scheduler: LRScheduler | None = None,
    ) -> Boosted:
        if isinstance(model, GeminiModel):
            boosted = model
        elif isinstance(model, ModelWrapper):
            raise ValueError("GeminiPlugin: the model was already boosted by another plugin")
        else:
            lazy = LazyModel(model) if is_lazy(model) else None  # captured before ShardFormer re-points anything
            if self.shardformer is not None:  # tensor parallelism first, in place: Gemini then chunks the TP shards
                shard_for_gemini(model, self.shardformer, self.layout)
            if self.options.use_fp8:  # the plain Linear layers ShardFormer left (all of them with tp_size 1)
                convert_linears_to_fp8(model, "GeminiPlugin", Fp8Options(recipe=self.options.fp8_recipe))
            # a lazily built model is materialised into the chunks one parameter at a time (no rank holds it
            # whole); with chunk_init_device the parameters go straight to that device (the CPU: the accelerator
            # never holds the whole model); GeminiDDP moves them, and the buffers, where they belong
            source = None if lazy is None else SlicedSource(lazy, self.layout.group_or_none(Axis.TP))
            target = (
                model
                if self.options.ddp.chunk_init_device is not None or source is not None
                else model.to(get_accelerator().current_device())
            )
            ddp = GeminiDDP(
                target,
                options=self.options.ddp,
                zero_group=self.layout.group(Axis.ZERO),
                extra_dp_group=self.layout.group_or_none(Axis.EXTRA_DP),
                memstats=self.options.memstats,
                verbose=self.options.verbose,
                parameter_source=source,
            )
            boosted = GeminiModel(ddp)
        wrapped: OptimizerWrapper | None = None
        if optimizer is not None:
            tp_group = self.layout.group_or_none(Axis.TP)
            gemini = GeminiOptimizer(
                optimizer,
                boosted.ddp,
                verbose=self.options.verbose,
                options=self.options.optimizer,
                tp_group=self.layout.group_or_none(Axis.TP),
                tp_split_params=tp_split_names(boosted.unwrap()) if self.shardformer is not None else None,
                tp_whole=None if tp_group is None else partial(GeminiTensorParallelWhole, group=tp_group),
            )
            self._gemini_of[optimizer] = gemini
            wrapped = GeminiOptimizerWrapper(optimizer, gemini)
        return boosted, wrapped, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        if self.layout.size(Axis.TP) > 1:
            return GeminiTPCheckpointIO(self._gemini_of.get, self.layout.group(Axis.TP))
        return GeminiCheckpointIO(self._gemini_of.get)

    def no_sync(
        self, model: nn.Module, optimizer: OptimizerWrapper | None = None
    ) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError(
            "GeminiPlugin does not support no_sync: use GeminiPlugin(enable_gradient_accumulation=True) and call "
            "backward on each micro-batch before one step()"
        )
