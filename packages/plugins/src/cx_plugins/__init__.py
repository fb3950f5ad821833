"""cx-plugins: the Booster and its plugins, with ColossalAI's names and arguments.

Present: `Booster`, `Plugin`, `DPPluginBase`, `TorchDDPPlugin`, the wrappers, and reference models in
`cx_plugins.models`. The ZeRO plugins and checkpoint IO arrive with the packages they compose.
"""

from cx_plugins._booster import Booster
from cx_plugins._plugin import DPPluginBase, Plugin
from cx_plugins._precision import Precision
from cx_plugins._torch_ddp_plugin import TorchDDPPlugin
from cx_plugins._wrappers import ModelWrapper, OptimizerWrapper

__all__ = ["Booster", "DPPluginBase", "ModelWrapper", "OptimizerWrapper", "Plugin", "Precision", "TorchDDPPlugin"]
