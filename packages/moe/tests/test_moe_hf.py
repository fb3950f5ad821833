"""transformers 5 MoE models (tiny configs, no download) made expert-parallel with `expert_parallelize_hf` against
the unconverted model on one process: logits, loss with the aux load-balancing loss, router logits, every gradient
(data-parallel semantics: each rank its own batch, the reference loss the mean over ranks) and state-dict names."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import distributed
from cx_moe import UnknownMoeBlockError, expert_parallelize_hf, is_moe_tensor, pooled_load_balancing_loss
from moe_test_helpers import FP32, compare_to_reference, groups, reduce_like_data_parallel

transformers = pytest.importorskip("transformers")

COMMON: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 32,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.05,
}


def _model(family: str) -> nn.Module:
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **COMMON, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
        )
        model: nn.Module = transformers.MixtralForCausalLM(config)
        return model
    if family in ("qwen3_moe", "qwen2_moe"):
        extra: dict[str, Any] = {"shared_expert_intermediate_size": 8} if family == "qwen2_moe" else {"head_dim": 8}
        config_class = transformers.Qwen3MoeConfig if family == "qwen3_moe" else transformers.Qwen2MoeConfig
        config = config_class(
            **COMMON,
            **extra,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=family == "qwen3_moe",
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
        model_class = transformers.Qwen3MoeForCausalLM if family == "qwen3_moe" else transformers.Qwen2MoeForCausalLM
        qwen: nn.Module = model_class(config)
        return qwen
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"},
        num_key_value_heads=2,
        intermediate_size=16,
        moe_intermediate_size=8,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        routed_scaling_factor=2.5,
    )
    deepseek: nn.Module = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():  # a non-trivial correction bias, so selection and weights differ
        for module in deepseek.modules():
            if hasattr(module, "e_score_correction_bias"):
                getattr(module, "e_score_correction_bias").copy_(torch.randn(4) * 0.05)  # noqa: B009
    return deepseek


def _batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(0, 64, (2, 6), generator=g)


def _loss(model: nn.Module, ids: torch.Tensor, family: str) -> tuple[torch.Tensor, Any]:
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    loss = out.loss
    if family == "deepseek_v3":  # transformers adds no aux loss for DeepSeek-V3: pool one from the router logits
        probs = [torch.softmax(logits, dim=-1) for logits in out.router_logits]
        loss = loss + 0.05 * pooled_load_balancing_loss(probs, [p.topk(2).indices for p in probs], 4)
    return loss, out


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_hf_moe_expert_parallel_matches_unconverted(rank: int, world_size: int, family: str) -> None:
    if world_size == 4 and family not in ("mixtral", "deepseek_v3"):
        pytest.skip("moe_dp x ep at 4 ranks runs for two families, to keep the suite short")
    ep_group, moe_dp_group = groups(2)
    torch.manual_seed(0)
    reference = _model(family)
    model = copy.deepcopy(reference)
    names = [n for n, _ in reference.state_dict().items()]
    converted = expert_parallelize_hf(model, ep_group, moe_dp_group)
    assert converted
    assert all(n.endswith(".mlp") for n in converted)
    assert list(model.state_dict()) == names  # parameter and buffer names unchanged
    for name, p in model.named_parameters():
        full = dict(reference.named_parameters())[name]
        if is_moe_tensor(p):
            assert p.shape[0] * 2 == full.shape[0], name
            assert p.shape[1:] == full.shape[1:], name
    reference.train()
    model.train()

    total = torch.zeros(())
    for r in range(world_size):
        ref_loss, ref_out = _loss(reference, _batch(r), family)
        total = total + ref_loss / world_size
        if r == rank:
            mine = (ref_loss.detach(), ref_out.logits.detach(), [t.detach() for t in ref_out.router_logits])
            ref_aux = None if ref_out.aux_loss is None else ref_out.aux_loss.detach()
    total.backward()

    loss, out = _loss(model, _batch(rank), family)
    loss.backward()
    torch.testing.assert_close(out.logits, mine[1], **FP32, msg="logits")
    torch.testing.assert_close(loss.detach(), mine[0], **FP32, msg="loss with aux")
    if ref_aux is not None:
        assert out.aux_loss is not None
        assert out.aux_loss.item() > 0
        torch.testing.assert_close(out.aux_loss, ref_aux, **FP32, msg="aux loss")
    for got, want in zip(out.router_logits, mine[2], strict=True):
        torch.testing.assert_close(got, want, **FP32, msg="router logits")
    reduce_like_data_parallel(model)
    compare_to_reference(model, reference, dist.get_rank(ep_group), 2, family)


class _OddBlock(nn.Module):
    """A MoE-looking block cx does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Module()
        self.experts.register_parameter("w", nn.Parameter(torch.zeros(4, 2, 2)))


@distributed(world_size=2)
def test_hf_conversion_errors(rank: int, world_size: int) -> None:
    ep_group, moe_dp_group = groups(2)
    with pytest.raises(UnknownMoeBlockError, match=r"_OddBlock.*not a MoE block cx knows"):
        expert_parallelize_hf(nn.Sequential(_OddBlock()), ep_group, moe_dp_group)
    with pytest.raises(ValueError, match="no MoE block"):
        expert_parallelize_hf(nn.Linear(2, 2), ep_group, moe_dp_group)
    torch.manual_seed(0)
    model: Any = _model("mixtral")
    block = model.model.layers[0].mlp
    block.experts.is_transposed = True  # as a future layout change would look
    with pytest.raises(UnknownMoeBlockError, match=r"layout for this block changed.*is_transposed"):
        expert_parallelize_hf(model, ep_group, moe_dp_group)
    block.experts.is_transposed = False
    expert_parallelize_hf(model, ep_group, moe_dp_group)
    with pytest.raises(ValueError, match="already expert-parallel"):
        expert_parallelize_hf(model, ep_group, moe_dp_group)
    config = transformers.MixtralConfig(**COMMON, intermediate_size=8, num_local_experts=3, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"num_experts=3 does not split over ep_size=2; ep sizes that work: \[1, 3\]"):
        expert_parallelize_hf(transformers.MixtralForCausalLM(config), ep_group, moe_dp_group)
