"""MoE policies (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; tiny configs, fp32) against the unsharded model on one
process: tp 2 with experts whole (ep 1) and tp 2 x ep 2 on the same two ranks, then tp 2 x ep 2 on four ranks (ep
over the data-parallel ranks, each its own batch). Logits, loss with the aux loss (transformers' with
`output_router_logits=True`; a pooled one for DeepSeek-V3, which has none in transformers), every gradient (expert
gradients slice by slice), an AdamW step and the state-dict names. Skips without transformers."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import TEST_ADAM_EPS, distributed, tiny_model_adam_tolerance
from cx_moe import get_moe_info, pooled_load_balancing_loss
from cx_shardformer import ShardConfig, ShardFormer, get_shard_spec
from cx_shardformer.policies import (
    DeepseekV3ForCausalLMPolicy,
    MixtralForCausalLMPolicy,
    MoEDecoderPolicy,
    Qwen2MoeForCausalLMPolicy,
    Qwen3MoeForCausalLMPolicy,
    get_autopolicy,
)
from shardformer_helpers import assert_close, full_grad, full_value
from shardformer_models import full_logits

transformers = pytest.importorskip("transformers")

VOCAB = 50
POLICY: dict[str, type[MoEDecoderPolicy]] = {
    "mixtral": MixtralForCausalLMPolicy,
    "qwen2_moe": Qwen2MoeForCausalLMPolicy,
    "qwen3_moe": Qwen3MoeForCausalLMPolicy,
    "deepseek_v3": DeepseekV3ForCausalLMPolicy,
}
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.05,
    "tie_word_embeddings": False,
}


def build(family: str) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **COMMON, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
        )
        model = transformers.MixtralForCausalLM(config)
    elif family in ("qwen3_moe", "qwen2_moe"):  # layer 0 dense (mlp_only_layers), layer 1 MoE
        qwen2 = family == "qwen2_moe"  # Qwen2-MoE: q/k/v biases, a gated shared expert
        extra: dict[str, Any] = {"shared_expert_intermediate_size": 8} if qwen2 else {"head_dim": 8}
        config = (transformers.Qwen2MoeConfig if qwen2 else transformers.Qwen3MoeConfig)(
            **COMMON,
            **extra,
            intermediate_size=16,
            moe_intermediate_size=8,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=not qwen2,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )
        model = (transformers.Qwen2MoeForCausalLM if qwen2 else transformers.Qwen3MoeForCausalLM)(config)
    else:  # layer 0 dense, layer 1 MoE with a shared expert; MLA with a low-rank query unless "_plain_q"
        config = transformers.DeepseekV3Config(  # multi-head latent attention: as many key/value heads as heads
            **{**COMMON, "num_key_value_heads": 4},
            intermediate_size=16,
            moe_intermediate_size=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            q_lora_rank=None if family.endswith("_plain_q") else 8,
            kv_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=4,
            routed_scaling_factor=2.5,
        )
        model = transformers.DeepseekV3ForCausalLM(config)
    return model


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(200 + seed))


def _pooled_aux(router_logits: tuple[torch.Tensor, ...]) -> torch.Tensor:
    probs = [torch.softmax(logits, dim=-1) for logits in router_logits]
    return pooled_load_balancing_loss(probs, [p.topk(2).indices for p in probs], 4)


def compare_grads(model: nn.Module, reference: nn.Module, what: str, tp_group: Any = None) -> None:
    """Every gradient: TP shards gathered to full size, expert slices against the reference's rows."""
    ref_params = dict(reference.named_parameters())
    assert {n for n, _ in model.named_parameters()} == set(ref_params), f"{what}: parameter names differ"
    for name, param in model.named_parameters():
        ref_grad = ref_params[name].grad
        assert ref_grad is not None, f"{what}: reference {name} has no grad"
        info = get_moe_info(param)
        if info is not None:  # this rank's experts (gathered over tp when they are also tensor-parallel)
            local = info.num_experts // info.ep_size
            ref_grad = ref_grad[info.ep_rank * local : (info.ep_rank + 1) * local]
        assert_close(full_grad(param, tp_group), ref_grad, f"{what}: grad of {name}")


# One AdamW step at TEST_ADAM_EPS: the step is a smooth function of the gradient, so TP differs by rounding alone
ADAM_ATOL = tiny_model_adam_tolerance(1e-2, steps=1, tokens=2 * 8)


def compare_values(model: nn.Module, reference: nn.Module, what: str) -> None:
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = ref_params[name].detach()
        info = get_moe_info(param)
        if info is not None:
            local = info.num_experts // info.ep_size
            expected = expected[info.ep_rank * local : (info.ep_rank + 1) * local]
        assert_close(full_value(param), expected, f"{what}: {name}", rtol=1e-4, atol=ADAM_ATOL)


@distributed(world_size=2)
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("mode", ["ep1", "ep2", "expert_tp"])
def test_shardformer_moe_policy_matches_unsharded(rank: int, world_size: int, family: str, mode: str) -> None:
    """ep1: experts whole (replicated over tp); ep2: experts split over the same two ranks; expert_tp: each expert's
    intermediate dimension split over tp."""
    model = build(family)
    reference = copy.deepcopy(model)
    names = set(reference.state_dict())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-2, eps=TEST_ADAM_EPS
    )  # built before TP: TP keeps the Parameter objects
    ep = 2 if mode == "ep2" else 1
    config = ShardConfig(ep_group=dist.group.WORLD if ep == 2 else None)
    policy = POLICY[family](expert_tensor_parallel=True) if mode == "expert_tp" else None
    model, _ = ShardFormer(config).optimize(model, policy)
    if ep == 2:  # expert parallelism replaces the expert Parameters: a new optimizer over the model's parameters
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    params = dict(model.named_parameters())
    attention = "self_attn.q_proj.weight" if family != "deepseek_v3" else "self_attn.q_b_proj.weight"
    assert get_shard_spec(params[f"model.layers.0.{attention}"]) is not None
    assert get_shard_spec(params["model.layers.0.mlp.gate_proj.weight" if family != "mixtral" else "lm_head.weight"])
    if family == "qwen2_moe":
        assert get_shard_spec(params["model.layers.1.mlp.shared_expert.up_proj.weight"]) is not None
        assert get_shard_spec(params["model.layers.0.self_attn.q_proj.bias"]) is not None
    if family == "deepseek_v3":
        assert get_shard_spec(params["model.layers.1.mlp.shared_experts.up_proj.weight"]) is not None
        assert get_shard_spec(params["model.layers.1.self_attn.kv_b_proj.weight"]) is not None
        assert get_shard_spec(params["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"]) is None  # replicated
    experts = params["model.layers.1.mlp.experts.gate_up_proj"]
    assert experts.shape[0] == 4 // ep
    assert (get_moe_info(experts) is not None) == (ep == 2)
    assert (get_shard_spec(experts) is not None) == (mode == "expert_tp")

    ids = tokens(0)
    out = model(input_ids=ids, labels=ids)
    ref_out = reference(input_ids=ids, labels=ids)
    loss, ref_loss = out.loss, ref_out.loss
    if family != "deepseek_v3":
        assert out.aux_loss is not None
        assert float(out.aux_loss) > 0
        assert_close(out.aux_loss, ref_out.aux_loss.detach(), f"{family} aux loss")
    else:  # transformers adds no aux loss for DeepSeek-V3: a pooled one from the router logits, as cx-moe's tests do
        for got, want in zip(out.router_logits, ref_out.router_logits, strict=True):
            assert_close(got, want.detach(), f"{family} router logits")
        loss = loss + 0.05 * _pooled_aux(out.router_logits)
        ref_loss = ref_loss + 0.05 * _pooled_aux(ref_out.router_logits)
    assert_close(loss, ref_loss.detach(), f"{family} {mode} loss")
    assert_close(full_logits(out.logits, True)[..., :VOCAB], ref_out.logits.detach(), f"{family} logits")
    loss.backward()
    ref_loss.backward()
    compare_grads(model, reference, f"{family} tp2 {mode}")
    optimizer.step()
    ref_optimizer.step()
    compare_values(model, reference, f"{family} tp2 {mode} after an AdamW step")
    assert set(model.state_dict()) == names, "state_dict names changed"


@pytest.mark.slow
@distributed(world_size=4)
def test_shardformer_moe_tp2_ep2_four_ranks(rank: int, world_size: int) -> None:
    """ColossalAI's MoE plugin mesh (moe_dp 1, ep 2, tp 2; dp = moe_dp x ep): tp 2 within each data-parallel pair,
    ep 2 over the dp ranks, each dp rank its own batch, dense gradients averaged over dp as data parallelism does
    (experts over moe-dp, a single rank here); the reference trains on both batches (mean loss). Mixtral also with
    its experts tensor-parallel inside each ep slice."""
    mesh = ProcessGroupMesh(1, 2, 2, axis_names=("moe_dp", "ep", "tp"))
    tp_group, dp_group = mesh.get_group_along_axis("tp"), mesh.get_group_along_axis(["moe_dp", "ep"])
    ep_group, moe_dp_group = mesh.get_group_along_axis("ep"), mesh.get_group_along_axis("moe_dp")
    dp_rank = dist.get_rank(dp_group)
    for family, expert_tp in (("mixtral", False), ("deepseek_v3_plain_q", False), ("mixtral", True)):
        model = build(family)
        reference = copy.deepcopy(model)
        config = ShardConfig(tensor_parallel_process_group=tp_group, ep_group=ep_group, moe_dp_group=moe_dp_group)
        policy = MixtralForCausalLMPolicy(expert_tensor_parallel=True) if expert_tp else None
        model, _ = ShardFormer(config).optimize(model, policy)
        family = f"{family} (experts tensor-parallel)" if expert_tp else family
        out = model(input_ids=tokens(dp_rank), labels=tokens(dp_rank))
        ref_losses = [reference(input_ids=tokens(i), labels=tokens(i)).loss for i in range(2)]
        ref_loss = sum(ref_losses) / 2
        assert isinstance(ref_loss, torch.Tensor)
        assert_close(out.loss, ref_losses[dp_rank].detach(), f"{family} 4 ranks loss")
        out.loss.backward()
        ref_loss.backward()
        for param in model.parameters():  # data parallelism: dense gradients averaged over dp; experts are already
            if get_moe_info(param) is None and param.grad is not None:
                dist.all_reduce(param.grad, group=dp_group)
                param.grad /= 2
        compare_grads(model, reference, f"{family} tp2 x ep2 on 4 ranks", tp_group)


@distributed(world_size=2)
def test_shardformer_moe_policy_errors(rank: int, world_size: int) -> None:
    """Unsupported options raise before the model changes: split_gather sequence parallelism with shared experts
    inside the MoE blocks or with experts split over tp, experts tensor-parallel over the ep group itself, an ep size
    that does not divide the experts (checked on every rank), and an ep group given for a dense model."""
    assert isinstance(get_autopolicy(build("mixtral")), MixtralForCausalLMPolicy)
    model = build("mixtral")
    split_gather = ShardConfig(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")
    with pytest.raises(NotImplementedError, match=r"split_gather .* shared experts .* use all_to_all or ring_attn"):
        ShardFormer(split_gather).optimize(build("qwen2_moe"))
    with pytest.raises(NotImplementedError, match=r"split_gather .* expert_tensor_parallel=True"):
        ShardFormer(split_gather).optimize(model, MixtralForCausalLMPolicy(expert_tensor_parallel=True))

    with pytest.raises(ValueError, match="the tp and ep groups to meet only in this rank"):
        ShardFormer(ShardConfig(ep_group=dist.group.WORLD)).optimize(model, MixtralForCausalLMPolicy(True))
    odd = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**COMMON, intermediate_size=8, num_local_experts=3, num_experts_per_tok=2)
    )
    with pytest.raises(ValueError, match="num_local_experts=3 is not divisible by the ep size 2"):
        ShardFormer(ShardConfig(ep_group=dist.group.WORLD)).optimize(odd)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**{k: v for k, v in COMMON.items() if "router" not in k}, intermediate_size=8)
    )
    with pytest.raises(ValueError, match="without expert parallelism; ep_group has 2 ranks"):
        ShardFormer(ShardConfig(ep_group=dist.group.WORLD)).optimize(llama)  # a dense model: nothing to split
    assert get_shard_spec(dict(model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]) is None
