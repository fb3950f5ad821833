"""MoeHybridParallelPlugin against single-process fp32 training of a tiny HF Mixtral with the aux loss on
(`output_router_logits=True`): ep 2 on two ranks (moe_dp 1) at zero_stage 0, 1 and 2, moe_dp 2 x ep 2 and
tp 2 x ep 2 on four, with and without clipping by the global norm, with frozen experts and with experts no token
reaches; fp16 and bf16 within their tolerances. Data-parallel semantics: each rank trains on its own rows, the
reference on the mean of the ranks' losses (each with its own aux loss). Losses every step and every parameter after
five steps (fp32: within 1e-4 relative), TP shards and expert slices gathered by name. Then each configuration the
plugin refuses."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import distributed
from cx_moe import get_moe_info
from cx_plugins import Booster, HybridParallelModule, MoeHybridParallelPlugin
from cx_plugins._layout import LayoutError
from cx_shardformer import get_shard_spec, unshard_tensor

transformers = pytest.importorskip("transformers")

VOCAB, ROWS, LENGTH, LR, STEPS = 50, 4, 8, 0.1, 5


def mixtral(top_k: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=top_k,
        output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(100 + step))


def unrouted_mixtral() -> nn.Module:
    """Top-1 routing to experts 0 or 1 only (frozen router: logits (a, -a, 0, 0)): ep rank 1's experts 2 and 3
    never receive a token."""
    model = mixtral(top_k=1)
    gates = [p for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")]
    assert len(gates) == 2
    for weight in gates:
        with torch.no_grad():
            weight[1].copy_(-weight[0])
            weight[2:].zero_()
        weight.requires_grad_(False)
    return model


def train_and_compare(
    plugin: MoeHybridParallelPlugin,
    clip: float = 0.0,
    freeze_experts: bool = False,
    model_fn: Callable[[], nn.Module] = mixtral,
    steps: int = STEPS,
    tol: float = 1e-4,
) -> tuple[Booster, HybridParallelModule]:
    model = model_fn()
    if freeze_experts:
        for name, param in model.named_parameters():
            if ".experts." in name:
                param.requires_grad_(False)
    reference = copy.deepcopy(model)
    booster = Booster(plugin=plugin)
    optimizer_in = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    boosted, optimizer, *_ = booster.boost(model, optimizer_in)
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    experts = [n for n, p in boosted.unwrap().named_parameters() if get_moe_info(p) is not None]
    assert len(experts) == 4, f"the experts of both layers are split over ep: {experts}"
    ref_optimizer = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR, momentum=0.9)
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = ROWS // dp_size
    losses, expected = [], []
    for step in range(steps):
        ids = rows(step)
        mine = ids[dp_rank * share : (dp_rank + 1) * share]
        loss = boosted(input_ids=mine, labels=mine).loss
        booster.backward(loss, optimizer)
        if clip > 0:
            optimizer.clip_grad_by_norm(clip)
        optimizer.step()
        optimizer.zero_grad()
        pieces = [reference(input_ids=ids[r * share : (r + 1) * share], labels=ids[r * share : (r + 1) * share]).loss
                  for r in range(dp_size)]  # fmt: skip
        sum(pieces).div(dp_size).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(float(loss))
        expected.append(float(pieces[dp_rank]))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=tol, atol=tol / 10)
    compare_parameters(boosted, reference, plugin, tol)
    return booster, boosted


def compare_parameters(
    boosted: HybridParallelModule, reference: nn.Module, plugin: MoeHybridParallelPlugin, tol: float
) -> None:
    """Every parameter by name; an expert slice gathered over the ep group along the expert dimension first."""
    expected = dict(reference.named_parameters())
    for name, param in boosted.unwrap().named_parameters():
        full = param.detach()
        spec = get_shard_spec(param)
        if spec is not None:
            full = unshard_tensor(full, spec, plugin.tp_group)
        if get_moe_info(param) is not None:
            pieces = [torch.empty_like(full) for _ in range(plugin.ep_size)]
            dist.all_gather(pieces, full.contiguous(), group=plugin.ep_group)
            full = torch.cat(pieces, dim=0)
        torch.testing.assert_close(full.float(), expected[name].detach(), rtol=tol, atol=tol / 10, msg=_named(name))


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plugins_moe_hybrid_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 1, 2)
    train_and_compare(plugin)  # checkpoints: test_plugins_moe_checkpoint.py


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_plugins_moe_hybrid_ep2_overlap(rank: int, world_size: int, zero_stage: int) -> None:
    """overlap_communication=True is kept with experts (ColossalAI turns it off and ZeRO-2 into ZeRO-1)."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, overlap_communication=True
    )
    train_and_compare(plugin, model_fn=unrouted_mixtral)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_ep2_clipped(rank: int, world_size: int, zero_stage: int) -> None:
    """The global norm counts each expert slice once and each dense gradient once (not once per ep rank)."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, clip=0.05)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_moe_hybrid_frozen_experts(rank: int, world_size: int, zero_stage: int) -> None:
    """No trainable expert parameter (ColossalAI #6237 raises here): the dense part trains, the experts stay."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, freeze_experts=True)


@distributed(world_size=4)
@pytest.mark.parametrize(("zero_stage", "moe_dp_outside"), [(0, True), (2, False)])
def test_plugins_moe_hybrid_moe_dp2_ep2(rank: int, world_size: int, zero_stage: int, moe_dp_outside: bool) -> None:
    """moe_dp 2 x ep 2: expert slices averaged over moe_dp, dense parameters over all four data-parallel ranks."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, moe_dp_outside=moe_dp_outside
    )
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 4)
    train_and_compare(plugin, clip=0.05 if zero_stage == 0 else 0.0)


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_moe_hybrid_tp2_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    """tp 2 x ep 2: attention split over tp (experts whole within each tp pair), experts over the ep pair."""
    plugin = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.tp_size, plugin.ep_size, plugin.dp_size) == (2, 2, 2)
    train_and_compare(plugin, clip=0.05)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_unrouted_experts(rank: int, world_size: int, zero_stage: int) -> None:
    """Experts that no token reaches (ColossalAI downgrades ZeRO-2 to ZeRO-1 because they hang it): same result."""
    with torch.no_grad():
        logits = unrouted_mixtral()(input_ids=rows(0), labels=rows(0)).router_logits
    assert all(int(layer.argmax(-1).max()) <= 1 for layer in logits), "experts 2 and 3 must get no token"
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, model_fn=unrouted_mixtral)


@distributed(world_size=2)
@pytest.mark.parametrize(("precision", "tol"), [("fp16", 5e-3), ("bf16", 3e-2)])
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_low_precision(
    rank: int, world_size: int, precision: str, tol: float, zero_stage: int
) -> None:
    """fp16 / bf16 with fp32 master weights against fp32 training on one process, within the precision's tolerance."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision=precision, zero_stage=zero_stage, initial_scale=2**8
    )
    train_and_compare(plugin, steps=3, tol=tol)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"enable_sequence_overlap": True}, "enable_sequence_overlap"),
        ({"fp8_communication": True}, "fp8"),
        ({"use_fp8": True}, "fp8"),
    ],
)
def test_plugins_moe_hybrid_refuses(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"tp_size": 1, "pp_size": 1, "ep_size": 1, **kwargs}
    with pytest.raises(NotImplementedError, match=match):
        MoeHybridParallelPlugin(**arguments)


@distributed(world_size=2)
def test_plugins_moe_hybrid_bad_sizes(rank: int, world_size: int) -> None:
    with pytest.raises(LayoutError, match=r"not divisible by ep_size = 3; ep_size can be 1 or 2"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=3)
    with pytest.raises(LayoutError, match=r"not divisible by ep\*tp = 2\*2 = 4"):
        MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2)
    with pytest.raises(ValueError, match="ep_size must be a positive integer"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=0)
