"""The boosted model and optimizer wrappers the Booster hands back: the base pair, the engine optimizer, ZeRO's."""

from cx_plugins.wrappers._base import ModelWrapper, OptimizerWrapper, finite_or_raise
from cx_plugins.wrappers._engine_optimizer import EngineOptimizer, OptimizerEngine
from cx_plugins.wrappers._zero import CastModel, ZeroOptimizerWrapper

__all__ = [
    "CastModel",
    "EngineOptimizer",
    "ModelWrapper",
    "OptimizerEngine",
    "OptimizerWrapper",
    "ZeroOptimizerWrapper",
    "finite_or_raise",
]
