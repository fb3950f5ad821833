"""Reference models for tests, benchmarks and the demo, with deterministic initialisation.

Importing this package registers `GPTPolicy` with cx-shardformer, so `ShardFormer(config).optimize(GPT(...))`
picks it by class name.
"""

from cx_plugins.models._gpt import GPT, GPTConfig
from cx_plugins.models._gpt_policy import GPTPolicy
from cx_plugins.models._names import GPT_MODEL, MODEL_CHOICES, PRESETS
from cx_shardformer.policies import register_policy

register_policy("GPT", GPTPolicy)

__all__ = ["GPT", "GPT_MODEL", "MODEL_CHOICES", "PRESETS", "GPTConfig", "GPTPolicy"]
