"""Which random stream each dropout of a sharded Hugging Face decoder draws from (`_rng`).

- Attention probabilities (inside each decoder layer's attention module, functional dropout or SDPA's `dropout_p`,
  and the policy's `attention_probability_dropouts` modules): this rank's heads, so a stream per tensor-parallel rank,
  and per sequence-parallel rank under all_to_all, whose attention holds a head shard of the sp group too.
- Every other dropout inside a decoder layer acts on the hidden states: replicated without sequence parallelism (the
  default generator, the same on every rank), this rank's sequence shard with it (a stream per tp rank under
  split_gather, per sp rank under all_to_all and ring). A region over the whole layer covers functional dropout there
  too; it is entered only when the config names a positive dropout rate.
- Outside the decoder layers (embedding dropout) activations are replicated: untouched.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from cx_shardformer._config import SequenceParallelMode
from cx_shardformer._rng import add_dropout_region, dropout_stream
from cx_shardformer._sharder import get_submodule_or_none
from cx_shardformer.policies._decoder import DecoderPolicy

__all__ = ["install_dropout_streams"]

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _attention_rate(module: nn.Module) -> float | None:
    """The attention-probability dropout rate a transformers attention module passes on; None when unknown."""
    rate = getattr(module, "attention_dropout", None)
    if isinstance(rate, nn.Dropout):
        return rate.p
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        return float(rate)
    drop = getattr(module, "attn_dropout", None)
    return drop.p if isinstance(drop, nn.Dropout) else None


def _attention_active(module: nn.Module) -> bool:
    return module.training and _attention_rate(module) != 0.0


def _dropout_active(module: nn.Module) -> bool:
    return module.training and float(getattr(module, "p", 0.0)) > 0.0


def _config_has_dropout(config: Any) -> bool:
    values = vars(config).items() if hasattr(config, "__dict__") else ()
    return any(
        "drop" in name and isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        for name, value in values
    )


def install_dropout_streams(policy: DecoderPolicy) -> None:
    """Add the dropout regions of the module docstring to every decoder layer of `policy.model`. A no-op when
    nothing is sharded (tp 1 and no sequence parallelism): then every dropout is replicated."""
    config = policy.shard_config
    tp = [config.tensor_parallel_process_group] if config.enable_tensor_parallelism else []
    mode = config.sp_mode
    heads = dropout_stream(
        "attention heads", tp + ([config.sp_group] if mode is SequenceParallelMode.ALL_TO_ALL else [])
    )
    hidden = dropout_stream("sequence shard", [config.sp_group] if mode is not None else [])
    if heads is None and hidden is None:
        return
    hf_config = getattr(policy.model, "config", None)
    prefix = f"{policy.attention_name}."
    for layer in policy.decoder_layers():
        if hidden is not None:
            add_dropout_region(layer, hidden, lambda m: m.training and _config_has_dropout(hf_config))
        attention = get_submodule_or_none(layer, policy.attention_name)
        if attention is not None:
            add_dropout_region(attention, heads, _attention_active)
        for name, module in layer.named_modules():
            if not isinstance(module, _DROPOUTS):
                continue
            on_heads = name.startswith(prefix) and name[len(prefix) :] in policy.attention_probability_dropouts
            add_dropout_region(module, heads if on_heads else hidden, _dropout_active)
