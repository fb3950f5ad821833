"""`LowLevelZeroPlugin`: ZeRO stage 1/2 over cx-zero's `LowLevelZeroOptimizer`, and the ZeRO checkpoint IO."""

from cx_plugins.low_level_zero._plugin import LowLevelZeroPlugin

__all__ = ["LowLevelZeroPlugin"]
