"""Routers and router losses against direct reimplementations of the formulas and against transformers' own
routers and `load_balancing_loss_func`; aux-loss-free expert-bias updates (also across ranks and micro-batches)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_moe import (
    RouterOptions,
    TopKRouter,
    collect_router_losses,
    load_balancing_loss,
    pooled_load_balancing_loss,
    register_expert_bias_update,
    router_z_loss,
    update_expert_bias,
)

H = 12


def _router(**kwargs: object) -> TopKRouter:
    torch.manual_seed(3)
    options = RouterOptions(**{"num_experts": 6, "top_k": 2, **kwargs})  # type: ignore[arg-type]
    return TopKRouter(H, options)


def _x(tokens: int = 10, seed: int = 0) -> torch.Tensor:
    return torch.randn(tokens, H, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("normalize", [True, False])
def test_softmax_router_matches_the_formula(normalize: bool) -> None:
    router = _router(normalize_top_k=normalize, scaling_factor=1.5)
    x = _x().to(torch.bfloat16)
    router.to(torch.bfloat16)
    out = router(x)
    logits = x.float() @ router.weight.float().T  # fp32 scoring of bf16 inputs
    probs = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
    top = probs.topk(2, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True) if normalize else top.values
    assert out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.probs, probs)
    torch.testing.assert_close(out.indices, top.indices)
    torch.testing.assert_close(out.weights, weights * 1.5)


def test_sigmoid_router_with_groups_and_bias_matches_the_formula() -> None:
    router = _router(score_function="sigmoid", num_groups=3, top_k_groups=2, expert_bias=True, scaling_factor=2.0)
    assert router.expert_bias is not None
    router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.2]))
    x = _x(16)
    out = router(x)
    scores = torch.sigmoid(x @ router.weight.T)
    choice = scores + router.expert_bias
    for t in range(16):
        groups = choice[t].view(3, 2)
        best_groups = groups.sum(-1).topk(2).indices.tolist()  # two experts per group: group score = their sum
        allowed = [g * 2 + i for g in best_groups for i in range(2)]
        masked = torch.full((6,), -torch.inf)
        masked[allowed] = choice[t, allowed]
        chosen = masked.topk(2).indices
        assert set(out.indices[t].tolist()) == set(chosen.tolist())
        w = scores[t, out.indices[t]]
        torch.testing.assert_close(out.weights[t], 2.0 * w / w.sum())


def test_expert_bias_changes_the_choice_not_the_weights() -> None:
    router = _router(expert_bias=True)
    x = _x()
    before = router(x)
    assert router.expert_bias is not None
    router.expert_bias[4] = 100.0
    after = router(x)
    assert (after.indices == 4).any(dim=-1).all()
    chosen_scores = before.probs.gather(1, after.indices)
    torch.testing.assert_close(after.weights, chosen_scores / chosen_scores.sum(-1, keepdim=True))


def test_jitter_only_in_training() -> None:
    router = _router(jitter_noise=0.1)
    x = _x()
    router.eval()
    torch.testing.assert_close(router(x).logits, x @ router.weight.T)
    router.train()
    torch.manual_seed(5)
    noisy = router(x).logits
    torch.manual_seed(5)
    expected = (x * torch.empty_like(x).uniform_(0.9, 1.1)) @ router.weight.T
    torch.testing.assert_close(noisy, expected)


def _switch_loss(probs: list[torch.Tensor], indices: list[torch.Tensor], experts: int) -> torch.Tensor:
    """Switch formula written out: E * sum_e (tokens to e / T) * (mean prob of e), layers pooled."""
    tokens = sum(p.shape[0] for p in probs)
    f = [sum(float((i == e).sum()) for i in indices) / tokens for e in range(experts)]
    p_mean = [sum(float(p[:, e].sum()) for p in probs) / tokens for e in range(experts)]
    return torch.tensor(experts * sum(a * b for a, b in zip(f, p_mean, strict=True)))


def test_load_balancing_loss_matches_formula_and_transformers() -> None:
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(t, 6, generator=g) for t in (9, 9, 9)]
    probs = [torch.softmax(x, dim=-1) for x in logits]
    indices = [p.topk(2).indices for p in probs]
    one = load_balancing_loss(probs[0], indices[0], 6)
    pooled = pooled_load_balancing_loss(probs, indices, 6)
    torch.testing.assert_close(one, _switch_loss(probs[:1], indices[:1], 6))
    torch.testing.assert_close(pooled, _switch_loss(probs, indices, 6))
    transformers = pytest.importorskip("transformers")
    hf = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func
    torch.testing.assert_close(one, hf((logits[0],), 6, 2))
    torch.testing.assert_close(pooled, hf(tuple(logits), 6, 2))


def test_z_loss_and_empty_batches() -> None:
    logits = torch.randn(7, 6, requires_grad=True)
    expected = torch.log(torch.exp(logits).sum(-1)).square().mean()
    torch.testing.assert_close(router_z_loss(logits), expected)
    router = _router(aux_loss_coef=0.5, z_loss_coef=0.25)
    out = router(torch.zeros(0, H))
    assert out.indices.shape == (0, 2)
    total = collect_router_losses(router)
    assert total.item() == 0.0
    total.backward()  # an empty rank still reaches the router in backward
    assert router.weight.grad is not None
    assert not router.weight.grad.any()


def test_collect_router_losses_weights_and_forgets() -> None:
    router = _router(aux_loss_coef=0.5, z_loss_coef=0.25)
    out = router(_x())
    expected = 0.5 * load_balancing_loss(out.probs, out.indices, 6) + 0.25 * router_z_loss(out.logits)
    torch.testing.assert_close(collect_router_losses(router), expected)
    assert collect_router_losses(router).item() == 0.0  # forgotten after collection


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"top_k": 7}, r"top_k must be in \[1, num_experts=6\], got 7"),
        ({"num_groups": 4}, "num_groups .4. must divide num_experts .6."),
        ({"score_function": "tanh"}, r"score_function must be one of \['softmax', 'sigmoid'\], got 'tanh'"),
        ({"num_groups": 3, "top_k_groups": 1, "top_k": 3}, "top_k=3 exceeds the experts"),
        ({"aux_loss_coef": -1.0}, "aux_loss_coef must be >= 0"),
    ],
)
def test_router_options_reject_bad_values(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RouterOptions(**{"num_experts": 6, "top_k": 2, **kwargs})  # type: ignore[arg-type]


def test_expert_bias_update_is_accumulation_safe() -> None:
    whole, halves = _router(expert_bias=True, bias_update_rate=0.01), _router(expert_bias=True, bias_update_rate=0.01)
    x = _x(20)
    whole(x)
    halves(x[:10])
    halves(x[10:])
    halves.eval()
    halves(x)  # evaluation forwards are not counted
    assert whole.expert_load is not None
    assert halves.expert_load is not None
    torch.testing.assert_close(whole.expert_load, halves.expert_load)
    load = whole.expert_load.clone()
    assert update_expert_bias(whole) == 1
    assert update_expert_bias(halves) == 1
    assert whole.expert_bias is not None
    assert halves.expert_bias is not None
    torch.testing.assert_close(whole.expert_bias, 0.01 * torch.sign(load.mean() - load))
    torch.testing.assert_close(whole.expert_bias, halves.expert_bias)
    assert not whole.expert_load.any()


def test_expert_bias_update_runs_after_the_optimizer_step() -> None:
    router = _router(expert_bias=True)
    optimizer = torch.optim.SGD(router.parameters(), lr=0.1)
    handle = register_expert_bias_update(optimizer, router)
    out = router(_x())
    (out.weights.sum()).backward()
    assert router.expert_bias is not None
    assert not router.expert_bias.any()
    optimizer.step()
    assert router.expert_bias.any()
    assert router.expert_load is not None
    assert not router.expert_load.any()
    handle.remove()


@distributed(world_size=2)
def test_expert_bias_update_sums_counts_over_ranks(rank: int, world_size: int) -> None:
    router, reference = _router(expert_bias=True), _router(expert_bias=True)
    router(_x(8, seed=rank))
    reference(torch.cat([_x(8, seed=r) for r in range(world_size)]))
    update_expert_bias(router, dist.group.WORLD)
    update_expert_bias(reference, group=None)  # the reference saw the whole batch: no reduction
    assert router.expert_bias is not None
    assert reference.expert_bias is not None
    torch.testing.assert_close(router.expert_bias, reference.expert_bias)


def test_routers_match_transformers_routers() -> None:
    transformers = pytest.importorskip("transformers")
    x = _x(16)
    torch.manual_seed(0)
    mixtral = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
        transformers.MixtralConfig(hidden_size=H, num_local_experts=6, num_experts_per_tok=2)
    )
    qwen3 = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
        transformers.Qwen3MoeConfig(hidden_size=H, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False)
    )
    deepseek = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(
        transformers.DeepseekV3Config(
            hidden_size=H, n_routed_experts=6, num_experts_per_tok=2, n_group=3, topk_group=2, routed_scaling_factor=2.5
        )
    )
    cases = [
        (mixtral, RouterOptions(6, 2)),
        (qwen3, RouterOptions(6, 2, normalize_top_k=False)),
        (
            deepseek,
            RouterOptions(
                6, 2, score_function="sigmoid", num_groups=3, top_k_groups=2, scaling_factor=2.5, expert_bias=True
            ),
        ),
    ]
    for hf, options in cases:
        with torch.no_grad():
            hf.weight.normal_()
            if hasattr(hf, "e_score_correction_bias"):
                hf.e_score_correction_bias.normal_(0, 0.1)
        ours = TopKRouter(H, options)
        ours.load_state_dict(
            {
                "weight": hf.weight.detach(),
                **({"expert_bias": hf.e_score_correction_bias} if options.expert_bias else {}),
            }
        )
        logits, weights, indices = hf(x)
        out = ours(x)
        torch.testing.assert_close(out.logits, logits.float())
        order, hf_order = out.indices.sort(-1), indices.sort(-1)
        torch.testing.assert_close(order.values, hf_order.values, msg=type(hf).__name__)
        torch.testing.assert_close(
            out.weights.gather(1, order.indices), weights.float().gather(1, hf_order.indices), msg=type(hf).__name__
        )
