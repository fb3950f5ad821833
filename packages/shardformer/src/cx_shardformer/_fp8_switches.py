"""ShardConfig's `use_fp8` and `fp8_communication` on the tensor-parallel layers.

`apply_fp8(model, shard_config)` runs once after a policy has sharded a model, whatever the policy: every column /
row layer whose local shard `fp8_eligible` accepts (and whose name no `Fp8Options.exclude` suffix names) computes
its matmul with `cx_mesh.fp8.fp8_linear`; with `fp8_communication` every layer's TP collectives go through the
`cx_mesh.fp8` collectives, and so does the vocabulary-parallel embedding's forward all-reduce (as ColossalAI's). The
cross entropy's reductions (`cross_entropy_1d`) stay plain float32: the loss is never quantized. The layers read two
attributes, off by default (`ParallelModule`): `fp8_recipe` (None: high precision) and `fp8_communication`.
"""

from __future__ import annotations

from torch import nn

from cx_mesh.fp8 import fp8_eligible
from cx_shardformer._config import ShardConfig
from cx_shardformer._linear import _ColumnBase, _RowBase
from cx_shardformer._vocab import VocabParallelEmbedding1D

__all__ = ["apply_fp8"]


def _local_dims(layer: _ColumnBase | _RowBase) -> tuple[int, int]:
    """(in, out) features of this rank's shard: Linear weights are [out, in], GPT-2 Conv1D weights [in, out]."""
    rows, cols = int(layer.weight.shape[0]), int(layer.weight.shape[1])
    conv1d = layer._out_dim == 1 if isinstance(layer, _ColumnBase) else layer._in_dim == 0
    return (rows, cols) if conv1d else (cols, rows)


def apply_fp8(model: nn.Module, config: ShardConfig) -> list[str]:
    """Set the fp8 attributes of every TP layer in `model` from `config`; returns the names computing in fp8."""
    if not config.use_fp8 and not config.fp8_communication:
        return []
    options = config.fp8_options
    converted: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding1D):
            module.fp8_communication = config.fp8_communication  # a lookup, not a matmul: use_fp8 leaves it alone
        if not isinstance(module, _ColumnBase | _RowBase):
            continue
        module.fp8_communication = config.fp8_communication
        if not config.use_fp8 or options.excludes(name):
            continue
        if fp8_eligible(*_local_dims(module), options):
            module.fp8_recipe = options.recipe
            converted.append(name)
    return converted
