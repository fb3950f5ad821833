"""MoeHybridParallelPlugin on a tiny HF Qwen3-MoE (fp32, aux loss on, `output_router_logits=True`) against
single-process training with the same data-parallel semantics, through moe_hybrid_test_helpers.py's
`train_and_compare` (losses every step, every parameter after five steps within 1e-4 relative): ep 2 at zero_stage
0, 1 and 2, tp 2 x ep 2 and moe_dp 2 x ep 2 on four ranks, and experts no token reaches at zero_stage 2. Qwen3-MoE
differs from Mixtral where the plugin could go wrong: per-head q/k RMSNorms (replicated over tp, gradients summed),
top-k weights renormalised (`norm_topk_prob`), and a dense `Qwen3MoeMLP` layer between the MoE ones
(`mlp_only_layers`) that is tensor-parallel but not expert-parallel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import MoeHybridParallelPlugin
from moe_hybrid_test_helpers import VOCAB, rows, train_and_compare, unrouted

transformers = pytest.importorskip("transformers")


def qwen3_moe(top_k: int = 2) -> nn.Module:
    """Three layers, the middle one dense: two MoE blocks of four experts (4 expert parameters, as with Mixtral)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=4, intermediate_size=12, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=top_k,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=32, output_router_logits=True,
        router_aux_loss_coef=0.05, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.Qwen3MoeForCausalLM(config)
    return model


def unrouted_qwen3_moe() -> nn.Module:
    """Top-1 routing to experts 0 or 1 only (frozen routers): ep rank 1's experts 2 and 3 never receive a token."""
    return unrouted(lambda: qwen3_moe(top_k=1))()


def test_qwen3_moe_preset_is_what_the_tests_mean() -> None:
    """The router starts random (not all-zero ties), layer 1 is dense, the aux loss is part of the loss."""
    model = qwen3_moe()
    named = dict(model.named_parameters())
    assert float(named["model.layers.0.mlp.gate.weight"].detach().abs().sum()) > 0
    assert "model.layers.1.mlp.gate_proj.weight" in named
    assert "model.layers.1.mlp.experts.down_proj" not in named
    out = model(input_ids=rows(0), labels=rows(0))
    assert out.aux_loss is not None
    assert float(out.aux_loss.detach()) > 0
    assert len(out.router_logits) == 2


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plugins_moe_hybrid_qwen3_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 1, 2)
    train_and_compare(plugin, model_fn=qwen3_moe, steps=5)


@distributed(world_size=4)
def test_plugins_moe_hybrid_qwen3_tp2_ep2(rank: int, world_size: int) -> None:
    """tp 2 x ep 2: attention (with its q/k norms) and the dense MLP split over tp, experts over the ep pair."""
    plugin = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2, precision="fp32", zero_stage=1)
    assert (plugin.tp_size, plugin.ep_size, plugin.dp_size) == (2, 2, 2)
    train_and_compare(plugin, model_fn=qwen3_moe, clip=0.05, steps=5)


@distributed(world_size=4)
def test_plugins_moe_hybrid_qwen3_moe_dp2_ep2(rank: int, world_size: int) -> None:
    """moe_dp 2 x ep 2 at zero 2: expert slices averaged over moe_dp, dense parameters over all four ranks."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=2)
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 4)
    train_and_compare(plugin, model_fn=qwen3_moe, steps=5)


@distributed(world_size=2)
def test_plugins_moe_hybrid_qwen3_unrouted_experts(rank: int, world_size: int) -> None:
    """Experts 2 and 3 get no token at zero 2: no hang, same result as one process."""
    with torch.no_grad():
        logits = unrouted_qwen3_moe()(input_ids=rows(0), labels=rows(0)).router_logits
    assert all(int(layer.argmax(-1).max()) <= 1 for layer in logits), "experts 2 and 3 must get no token"
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=2)
    train_and_compare(plugin, model_fn=unrouted_qwen3_moe, steps=5)
