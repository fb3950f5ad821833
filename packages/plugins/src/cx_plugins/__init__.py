"""cx-plugins: the Booster and its plugins, with ColossalAI's names and arguments.

Present: `Booster`, `Plugin`, `DPPluginBase`, `TorchDDPPlugin`, `TorchFSDPPlugin` (FSDP2), `LowLevelZeroPlugin`,
`GeminiPlugin` (with tensor parallelism), `HybridParallelPlugin` (tp/pp/sp + DDP-like or ZeRO-1/2),
`MoeHybridParallelPlugin` (experts over ep on top of it), `LazyInitContext` (with ColossalAI's
`is_compatible_with_meta`; build a model without allocating it; materialised at boost straight into Gemini chunks and
tensor-parallel slices), the wrappers (`EngineOptimizer`, the one boosted
optimizer over any `OptimizerEngine`), `HybridCheckpointIO` with the faces it reads (`ParallelModelView`,
`ParallelOptimizerView`) for models split by tensor and pipeline parallelism,
`accumulated_step` (one optimizer step over micro-batches, communicating on the last),
`enable_activation_checkpointing(model, "full" | "selective-op")` (torchtitan's op policy, `SelectiveOpPolicy`),
reference models in `cx_plugins.models`, ColossalAI's learning-rate schedulers in `cx_plugins.lr_scheduler`; every
plugin saves and loads the canonical cx checkpoint format. `ParallelLayout` (with `Axis`, `FILL`, `resolve_sizes`)
is the one object that owns a plugin's mesh and its named axes. `__version__` is the installed distribution's version.
"""

from importlib import metadata as _metadata

from cx_plugins._accumulation import accumulated_step
from cx_plugins._activation_checkpointing import SelectiveOpPolicy, enable_activation_checkpointing
from cx_plugins._booster import Booster
from cx_plugins._layout import FILL, Axis, LayoutError, ParallelLayout, resolve_sizes
from cx_plugins._plugin import DPPluginBase, Plugin
from cx_plugins._precision import Precision
from cx_plugins.checkpoint_io import ParallelModelView, ParallelOptimizerView
from cx_plugins.ddp import TorchDDPPlugin
from cx_plugins.fsdp import TorchFSDPPlugin
from cx_plugins.gemini import GeminiPlugin
from cx_plugins.hybrid import HybridCheckpointIO, HybridParallelModule, HybridParallelPlugin
from cx_plugins.lazy import LazyInitContext, is_compatible_with_meta
from cx_plugins.low_level_zero import LowLevelZeroPlugin
from cx_plugins.moe_hybrid import MoeHybridParallelPlugin
from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper
from cx_plugins.wrappers._engine_optimizer import EngineOptimizer, OptimizerEngine

try:
    __version__ = _metadata.version("cx-plugins")
except _metadata.PackageNotFoundError:  # imported from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "__version__",
    "accumulated_step",
    "Axis",
    "FILL",
    "LayoutError",
    "ParallelLayout",
    "resolve_sizes",
    "Booster",
    "DPPluginBase",
    "EngineOptimizer",
    "GeminiPlugin",
    "HybridCheckpointIO",
    "LazyInitContext",
    "HybridParallelModule",
    "HybridParallelPlugin",
    "LowLevelZeroPlugin",
    "MoeHybridParallelPlugin",
    "ModelWrapper",
    "OptimizerEngine",
    "OptimizerWrapper",
    "ParallelModelView",
    "ParallelOptimizerView",
    "Plugin",
    "Precision",
    "TorchDDPPlugin",
    "SelectiveOpPolicy",
    "TorchFSDPPlugin",
    "enable_activation_checkpointing",
    "is_compatible_with_meta",
]
