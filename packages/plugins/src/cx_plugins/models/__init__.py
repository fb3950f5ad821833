"""Reference models for tests, benchmarks and cx-train, with deterministic initialisation, and the tiny Hugging Face
presets (`preset_config`) that cx-train trains and cx-plan plans.

Importing this package registers `GPTPolicy` with cx-shardformer, so `ShardFormer(config).optimize(GPT(...))`
picks it by class name.
"""

from cx_plugins.models._gpt import GPT, GPTConfig, document_mask
from cx_plugins.models._gpt_policy import GPTPolicy
from cx_plugins.models._names import GPT_MODEL, MODEL_CHOICES, PRESETS
from cx_plugins.models._presets import preset_config
from cx_shardformer.policies import register_policy

register_policy("GPT", GPTPolicy)

__all__ = ["GPT", "GPT_MODEL", "MODEL_CHOICES", "PRESETS", "GPTConfig", "GPTPolicy", "document_mask", "preset_config"]
