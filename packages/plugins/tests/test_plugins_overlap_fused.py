"""enable_sequence_overlap and enable_jit_fused through the plugins at 2 ranks: tiny HF models trained a few steps
with the switch and without it, losses and parameters compared. Overlap: Llama under HybridParallelPlugin (tp 2,
split_gather). Fused kernels (compiled with the cheap aot_eager backend; inductor is tested in cx-shardformer):
GPT-2 with dropout on and off and Llama, under HybridParallelPlugin tp 2 and GeminiPlugin tp 2, and Mixtral under
MoeHybridParallelPlugin tp 2 (its RMSNorms fuse; its experts are transformers' fused 3-D stacks, no gated-MLP module).

Tolerance from the arithmetic: the ring computes every element as the same dot product as the plain all-gather /
reduce-scatter path and adds the two ranks' partial sums in either order alike, so the runs can differ only where a
GEMM kernel's summation order changes with the sequence chunk's row count: at most `sum_tolerance` of a gradient
element's terms per step (`tiny_model_sgd_tolerance`). The fused kernels compute each element with the unfused ops
and the same dropout mask; a compiled kernel may round an element differently by a few units in the last place,
which changes a gradient element by a few units of its terms' absolute sum, inside that bound's
CONFIDENCE * sqrt(64 * tokens) = 384 units, so the same bound holds, absolute, without an rtol: the only term that
scales with a parameter is the rounding of its update, at most u |p| = 6e-8 |p| a step, which for these models' O(1)
parameters the bound (1.4e-4 at 3 steps) dwarfs; the runs' Adam update differences are what it counts."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from cx_mesh.testing import TEST_ADAM_EPS, distributed, sum_tolerance, tiny_model_adam_tolerance
from cx_plugins import Booster, GeminiPlugin, HybridParallelModule, HybridParallelPlugin, MoeHybridParallelPlugin
from cx_plugins._layout import Axis
from cx_plugins.gemini._plugin import GeminiModel
from cx_shardformer import get_shard_spec, unshard_tensor
from hybrid_test_helpers import BATCH, LENGTH, LR, VOCAB, batch, llama

pytest.importorskip("transformers")

STEPS, MOMENTUM = 3, 0.9


def tiny_model_sgd_tolerance(steps: int, tokens: int) -> float:
    """Parameters' difference after `steps` SGD-with-momentum steps whose gradients differ by rounding only: each
    step moves by lr times the momentum sum of the gradient differences (1 + m + m^2 ...), the gradient elements of
    the tiny models summing 64 * tokens terms of absolute sum below 1e-2 (`tiny_model_adam_tolerance`); factor 2 for
    the feedback of a parameter difference into the next gradients."""
    grad = sum_tolerance(64 * tokens, 1e-2)
    moves = sum(sum(MOMENTUM**j for j in range(k + 1)) for k in range(steps))
    return 2 * LR * moves * grad


def _train(plugin: HybridParallelPlugin) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Losses, full parameters after the steps, and how many layers ran the overlap ring."""
    model = llama(layers=2)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    losses = []
    for step in range(STEPS):
        loss = boosted(**batch(step)).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    group = plugin.layout.group(Axis.TP)
    params = {}
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        params[name] = unshard_tensor(param.detach(), spec, group) if spec is not None else param.detach().clone()
    rings = sum(bool(getattr(m, "sequence_overlap", False)) for m in boosted.unwrap().modules())
    return losses, params, rings


def _named(what: str) -> Callable[[str], str]:
    return lambda message: f"{what}: {message}"


def _compare(got: Any, expected: Any, what: str) -> None:
    losses, params, _ = got
    ref_losses, ref_params, _ = expected
    tolerance = tiny_model_sgd_tolerance(STEPS, BATCH * LENGTH)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=tolerance)
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=tolerance, msg=_named(f"{what} {name}"))


@distributed(world_size=2)
def test_plugins_hybrid_sequence_overlap_matches_plain(rank: int, world_size: int) -> None:
    sizes: dict[str, Any] = {"tp_size": 2, "pp_size": 1, "precision": "fp32", "enable_sequence_parallelism": True}
    plain = _train(HybridParallelPlugin(sequence_parallelism_mode="split_gather", **sizes))
    plugin = HybridParallelPlugin(sequence_parallelism_mode="split_gather", enable_sequence_overlap=True, **sizes)
    overlapped = _train(plugin)
    _compare(overlapped, plain, "enable_sequence_overlap")
    # every q/k/v/o, gate/up/down of the 2 layers runs in the ring; none without the switch
    assert (overlapped[2], plain[2]) == (2 * 7, 0)
    # GeminiPlugin: sequence parallelism is split_gather on its tp group
    sequence: dict[str, Any] = {"enable_sequence_parallelism": True}
    plain_gemini = _train_adamw("gemini", llama(layers=2), **sequence)
    gemini = _train_adamw("gemini", llama(layers=2), enable_sequence_overlap=True, **sequence)
    assert (gemini[2], plain_gemini[2]) == (2 * 7, 0)
    tolerance = tiny_model_adam_tolerance(LR, STEPS, tokens=BATCH * LENGTH)
    torch.testing.assert_close(torch.tensor(gemini[0]), torch.tensor(plain_gemini[0]), rtol=0, atol=tolerance)
    for key, value in gemini[1].items():
        torch.testing.assert_close(value, plain_gemini[1][key], rtol=0, atol=tolerance, msg=_named(f"gemini {key}"))


def _gpt2(dropout: float) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False,
        resid_pdrop=dropout, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _mixtral() -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        router_jitter_noise=0.0, tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _plugin(kind: str, **switches: Any) -> Any:
    if kind == "hybrid":
        return HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", **switches)
    if kind == "moe_hybrid":
        return MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=1, precision="fp32", **switches)
    return GeminiPlugin(
        tp_size=2, precision="fp32", chunk_config_dict={"chunk_size": 1024}, placement_policy="static", **switches
    )


def _train_adamw(kind: str, model: Any, **switches: Any) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """AdamW steps (Gemini takes Adam-style optimizers) from one seed, so dropout draws alike: the losses, this
    rank's parameter shards, and how many modules run a fused kernel or the overlap ring."""
    booster = Booster(plugin=_plugin(kind, **switches))
    boosted: Any
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    torch.manual_seed(1234)
    losses = []
    for step in range(STEPS):
        loss = boosted(**batch(step)).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    module = boosted.unwrap()
    if isinstance(boosted, GeminiModel):
        params = boosted.state_dict(only_rank_0=False)
    else:
        params = {name: p.detach().clone() for name, p in module.named_parameters()}
    fused = sum(isinstance(m.forward, functools.partial) for m in module.modules())
    rings = sum(bool(getattr(m, "sequence_overlap", False)) for m in module.modules())
    return losses, params, fused + rings


def _fused_cases() -> None:
    cases: list[tuple[str, str, Callable[[], Any], int]] = [
        ("hybrid", "gpt2 dropout 0.1", lambda: _gpt2(0.1), 2),  # 2 MLPs
        ("hybrid", "gpt2 no dropout", lambda: _gpt2(0.0), 2),
        ("hybrid", "llama", lambda: llama(layers=2), 2 + 5),  # 2 gated MLPs, 5 RMSNorms
        ("gemini", "gpt2 dropout 0.1", lambda: _gpt2(0.1), 2),
        ("gemini", "llama", lambda: llama(layers=2), 2 + 5),
        ("moe_hybrid", "mixtral", _mixtral, 5),  # 5 RMSNorms; the experts are 3-D stacks, nothing else fuses
    ]
    tolerance = tiny_model_adam_tolerance(LR, STEPS, tokens=BATCH * LENGTH)
    for kind, name, build, sites in cases:
        plain = _train_adamw(kind, build(), enable_jit_fused=False)
        fused = _train_adamw(kind, build(), enable_jit_fused=True)
        assert (fused[2], plain[2]) == (sites, 0), f"{kind} {name}: fused modules"
        what = f"{kind} {name} enable_jit_fused"
        torch.testing.assert_close(torch.tensor(fused[0]), torch.tensor(plain[0]), rtol=0, atol=tolerance)
        for key, value in fused[1].items():
            torch.testing.assert_close(value, plain[1][key], rtol=0, atol=tolerance, msg=_named(f"{what} {key}"))


@distributed(world_size=2)
def test_plugins_jit_fused_matches_unfused(rank: int, world_size: int) -> None:
    backend = os.environ.get("CX_JIT_FUSED_BACKEND")
    os.environ["CX_JIT_FUSED_BACKEND"] = "aot_eager"  # in this worker process, for this test only
    try:
        _fused_cases()
    finally:
        if backend is None:
            del os.environ["CX_JIT_FUSED_BACKEND"]
        else:
            os.environ["CX_JIT_FUSED_BACKEND"] = backend
