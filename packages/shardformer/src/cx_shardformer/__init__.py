"""cx-shardformer: tensor- and sequence-parallel layers and ShardFormer for Hugging Face models.

- Layers under ColossalAI's names: `Linear1D_Col`, `Linear1D_Row`, `FusedLinear1D_Col`, `GPT2FusedLinearConv1D_Col`,
  `GPT2FusedLinearConv1D_Row`, `VocabParallelEmbedding1D`, `VocabParallelLMHead1D`, `cross_entropy_1d`. Each
  `from_native_module(module, process_group)` shards in place; state dicts are full-size.
- `ShardConfig`, `Policy`, `ShardFormer(shard_config).optimize(model, policy=None)`; `shard_sequence_at_stage(model,
  stage)` for each pipeline stage cut from a sequence-parallel model afterwards.
- `FirstCalls`: which calls of a layer or loss check ids exactly on the host (the first few; later ones assert on
  the device), for policies outside this package.
"""

from cx_shardformer._config import GradientCheckpointConfig, SequenceParallelMode, ShardConfig
from cx_shardformer._conv1d import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from cx_shardformer._ids import FirstCalls
from cx_shardformer._linear import FusedLinear1D_Col, Linear1D_Col, Linear1D_Row
from cx_shardformer._loss import cross_entropy_1d
from cx_shardformer._parallel_module import ParallelModule
from cx_shardformer._policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription
from cx_shardformer._ring import ring_attention, zigzag_positions
from cx_shardformer._shard_spec import ShardSpec, get_shard_spec, shard_tensor, unshard_tensor
from cx_shardformer._shardformer import ShardFormer
from cx_shardformer._spans import KeySpans
from cx_shardformer._vocab import VocabParallelEmbedding1D, VocabParallelLMHead1D
from cx_shardformer.policies._sequence import shard_sequence_at_stage

__all__ = [
    # sharding a model
    "GradientCheckpointConfig",
    "ModulePolicyDescription",
    "Policy",
    "SequenceParallelMode",
    "ShardConfig",
    "ShardFormer",
    "SubModuleReplacementDescription",
    # layers
    "FusedLinear1D_Col",
    "GPT2FusedLinearConv1D_Col",
    "GPT2FusedLinearConv1D_Row",
    "Linear1D_Col",
    "Linear1D_Row",
    "ParallelModule",
    "VocabParallelEmbedding1D",
    "VocabParallelLMHead1D",
    "cross_entropy_1d",
    "FirstCalls",
    # sequence parallelism
    "KeySpans",
    "ring_attention",
    "shard_sequence_at_stage",
    "zigzag_positions",
    # sharding metadata
    "ShardSpec",
    "get_shard_spec",
    "shard_tensor",
    "unshard_tensor",
]
