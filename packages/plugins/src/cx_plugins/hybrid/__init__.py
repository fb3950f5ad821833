"""`HybridParallelPlugin`: tensor, sequence and pipeline parallelism with DDP-like or ZeRO-1/2 data parallelism; its
options, boosted model and optimizers, replica agreement and checkpoint IO."""

from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from cx_plugins.hybrid._model import HybridParallelModule, compose_model
from cx_plugins.hybrid._plugin import HybridParallelPlugin

__all__ = ["HybridCheckpointIO", "HybridParallelModule", "HybridParallelPlugin", "compose_model"]
