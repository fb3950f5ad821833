"""enable_fused_normalization keeps training equal to one process of PyTorch where it used to be silently wrong:
- Gemma / Gemma 2 scale by `(1 + weight)`, weights starting at 0: swapped for `nn.RMSNorm(weight)` every norm gave 0
  and the logits were constant (loss log V). Their norms now keep their own forward (with a warning), and the run
  matches one process.
- With sequence parallelism the final norm carries the hook that gathers the sequence back: the swap dropped it and
  the logits came back sequence-sharded ((4, 8, V) for (4, 16, V)). The fused norm now keeps the hooks.
Losses every step and parameters after 3 steps within 1e-4 relative (hybrid_test_helpers.py)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import HybridParallelPlugin
from hybrid_test_helpers import VOCAB, llama, train_and_compare

transformers = pytest.importorskip("transformers")


def _gemma(version: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        config_class, model_class = {
            "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
            "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        }[version]
        config = config_class(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=32, num_hidden_layers=2, use_cache=False, attention_dropout=0.0,
        )  # fmt: skip
        model: nn.Module = model_class(config)
        with torch.no_grad():  # trained norms: weights away from 0, so (1 + w) and w tell apart
            for name, parameter in model.named_parameters():
                if "norm" in name:
                    parameter.normal_(0.0, 0.5)
        return model

    return build


@distributed(world_size=2)
@pytest.mark.parametrize("version", ["gemma", "gemma2"])
def test_plugins_fused_norm_gemma_keeps_its_own_norm(rank: int, world_size: int, version: str) -> None:
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", enable_fused_normalization=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_and_compare(plugin, model_fn=_gemma(version), steps=3)
    assert any("does not compute torch's RMSNorm" in str(w.message) for w in caught), [str(w.message) for w in caught]


@distributed(world_size=2)
@pytest.mark.parametrize(
    "layout",
    [
        {"tp_size": 2, "sequence_parallelism_mode": "split_gather"},
        {"tp_size": 2, "sequence_parallelism_mode": "ring"},
        {"tp_size": 1, "sp_size": 2, "sequence_parallelism_mode": "all_to_all"},
    ],
    ids=["split_gather", "ring", "all_to_all"],
)
def test_plugins_fused_norm_with_sequence_parallelism(rank: int, world_size: int, layout: dict[str, Any]) -> None:
    plugin = HybridParallelPlugin(
        pp_size=1, precision="fp32", enable_fused_normalization=True, enable_sequence_parallelism=True, **layout
    )
    train_and_compare(plugin, model_fn=llama, steps=3)  # the sharded logits failed the loss's shape check before
