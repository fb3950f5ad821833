"""cx-plugins: the Booster and its plugins, with ColossalAI's names and arguments.

Present: `Booster`, `Plugin`, `DPPluginBase`, `TorchDDPPlugin`, `LowLevelZeroPlugin`, `GeminiPlugin`, the wrappers,
and reference models in `cx_plugins.models`; every plugin saves and loads the canonical cx checkpoint format.
"""

from cx_plugins._booster import Booster
from cx_plugins._gemini_plugin import GeminiPlugin
from cx_plugins._low_level_zero_plugin import LowLevelZeroPlugin
from cx_plugins._plugin import DPPluginBase, Plugin
from cx_plugins._precision import Precision
from cx_plugins._torch_ddp_plugin import TorchDDPPlugin
from cx_plugins._wrappers import ModelWrapper, OptimizerWrapper

__all__ = [
    "Booster",
    "DPPluginBase",
    "GeminiPlugin",
    "LowLevelZeroPlugin",
    "ModelWrapper",
    "OptimizerWrapper",
    "Plugin",
    "Precision",
    "TorchDDPPlugin",
]
