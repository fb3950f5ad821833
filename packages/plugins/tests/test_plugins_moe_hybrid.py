"""MoeHybridParallelPlugin against single-process fp32 training of a tiny HF Mixtral with the aux loss on
(`output_router_logits=True`): ep 2 on two ranks (moe_dp 1) at zero_stage 0, 1 and 2, moe_dp 2 x ep 2 and
tp 2 x ep 2 on four, with and without clipping by the global norm (given to `clip_grad_by_norm` or as `max_norm`),
with frozen experts or frozen dense parameters, with experts no token reaches; fp16 and bf16 within their
tolerances. Data-parallel semantics: each rank trains on its own rows, the reference on the mean of the ranks' losses
(each with its own aux loss). Losses every step and every parameter after five steps (fp32: within 1e-4 relative),
TP shards and expert slices gathered by name. Then each configuration the plugin refuses (the errors name
MoeHybridParallelPlugin, not the HybridParallelPlugin it extends), and the constructor's arguments and defaults
against ColossalAI's."""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.fp8 import ScalingRecipe
from cx_mesh.testing import distributed
from cx_plugins import Booster, MoeHybridParallelPlugin
from cx_plugins._layout import LayoutError
from cx_shardformer.policies import NoPolicyError
from moe_hybrid_test_helpers import mixtral, rows, train_and_compare, unrouted

transformers = pytest.importorskip("transformers")

STEPS = 5


def unrouted_mixtral() -> nn.Module:
    """Top-1 routing to experts 0 or 1 only (frozen routers): ep rank 1's experts 2 and 3 never receive a token."""
    return unrouted(functools.partial(mixtral, top_k=1))()


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plugins_moe_hybrid_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 1, 2)
    train_and_compare(plugin, steps=STEPS)  # checkpoints: test_plugins_moe_checkpoint.py


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_plugins_moe_hybrid_ep2_overlap(rank: int, world_size: int, zero_stage: int) -> None:
    """overlap_communication=True is kept with experts (ColossalAI turns it off and ZeRO-2 into ZeRO-1)."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, overlap_communication=True
    )
    train_and_compare(plugin, model_fn=unrouted_mixtral, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_ep2_clipped(rank: int, world_size: int, zero_stage: int) -> None:
    """The global norm counts each expert slice once and each dense gradient once (not once per ep rank)."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, clip=0.05, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_max_norm(rank: int, world_size: int, zero_stage: int) -> None:
    """`max_norm` given to the constructor clips inside `optimizer.step()` by the same global norm."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, max_norm=0.05
    )
    train_and_compare(plugin, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_plugins_moe_hybrid_frozen_experts(rank: int, world_size: int, zero_stage: int) -> None:
    """No trainable expert parameter (ColossalAI #6237 raises here): the dense part trains, the experts stay."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, freeze_experts=True, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_frozen_dense(rank: int, world_size: int, zero_stage: int) -> None:
    """No trainable dense parameter (only the experts train, e.g. expert fine-tuning): the dense groups are empty."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, freeze_dense=True, steps=STEPS)


@distributed(world_size=4)
@pytest.mark.parametrize(("zero_stage", "moe_dp_outside"), [(0, True), (2, False)])
def test_plugins_moe_hybrid_moe_dp2_ep2(rank: int, world_size: int, zero_stage: int, moe_dp_outside: bool) -> None:
    """moe_dp 2 x ep 2: expert slices averaged over moe_dp, dense parameters over all four data-parallel ranks."""
    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage, moe_dp_outside=moe_dp_outside
    )
    assert (plugin.ep_size, plugin.moe_dp_size, plugin.dp_size) == (2, 2, 4)
    train_and_compare(plugin, clip=0.05 if zero_stage == 0 else 0.0, steps=STEPS)


@distributed(world_size=4)
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_plugins_moe_hybrid_tp2_ep2(rank: int, world_size: int, zero_stage: int) -> None:
    """tp 2 x ep 2: attention split over tp (experts whole within each tp pair), experts over the ep pair."""
    plugin = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    assert (plugin.tp_size, plugin.ep_size, plugin.dp_size) == (2, 2, 2)
    train_and_compare(plugin, clip=0.05, steps=STEPS)


@distributed(world_size=2)
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_plugins_moe_hybrid_unrouted_experts(rank: int, world_size: int, zero_stage: int) -> None:
    """Experts that no token reaches (ColossalAI downgrades ZeRO-2 to ZeRO-1 because they hang it): same result."""
    with torch.no_grad():
        logits = unrouted_mixtral()(input_ids=rows(0), labels=rows(0)).router_logits
    assert all(int(layer.argmax(-1).max()) <= 1 for layer in logits), "experts 2 and 3 must get no token"
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", zero_stage=zero_stage)
    train_and_compare(plugin, model_fn=unrouted_mixtral, steps=STEPS)


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


@distributed(world_size=2)
def test_plugins_moe_hybrid_bad_sizes(rank: int, world_size: int) -> None:
    with pytest.raises(LayoutError, match=r"not divisible by ep_size = 3; ep_size can be 1 or 2"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=3)
    with pytest.raises(LayoutError, match=r"not divisible by ep\*tp = 2\*2 = 4"):
        MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=2)
    with pytest.raises(ValueError, match="ep_size must be a positive integer"):
        MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=0)


NAMED_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"zero_stage": 3}, ValueError, "zero_stage must be 0, 1 or 2"),
    ({"max_norm": -1.0}, ValueError, "max_norm must be >= 0"),
    ({"pp_size": 2}, ValueError, "pipeline parallelism (pp_size > 1) needs num_microbatches or microbatch_size"),
    ({"pp_size": 2, "num_microbatches": 2, "pp_style": "gpipe"}, ValueError, "unknown pp_style 'gpipe'"),
    ({"sequence_parallelism_mode": "all_to_all"}, ValueError, "sequence_parallelism_mode='all_to_all' needs enable_"),
    ({"cpu_offload": True}, ValueError, "cpu_offload offloads ZeRO's optimizer state"),
    ({"custom_policy": "MixtralPolicy"}, TypeError, "custom_policy must be a cx_shardformer Policy instance"),
]


@distributed(world_size=2)
@pytest.mark.parametrize("case", range(len(NAMED_ERRORS)))
def test_plugins_moe_hybrid_errors_name_the_plugin(rank: int, world_size: int, case: int) -> None:
    """The validation MoeHybridParallelPlugin inherits names MoeHybridParallelPlugin, the class the user built."""
    overrides, error, message = NAMED_ERRORS[case]
    arguments: dict[str, Any] = {"tp_size": 1, "pp_size": 1, "ep_size": 1, **overrides}
    with pytest.raises(error, match="^" + re.escape(f"MoeHybridParallelPlugin: {message}")):
        MoeHybridParallelPlugin(**arguments)


@distributed(world_size=2)
def test_plugins_moe_hybrid_no_policy_names_custom_policy(rank: int, world_size: int) -> None:
    """A model without a policy (the experts cannot be split over ep) is told to pass this plugin's custom_policy=."""
    booster = Booster(plugin=MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32"))
    with pytest.raises(NoPolicyError, match="pass custom_policy=<a cx_shardformer Policy instance> to MoeHybrid"):
        booster.boost(nn.Sequential(nn.Linear(4, 4)))


REQUIRED = object()  # a parameter without a default
# ColossalAI's MoeHybridParallelPlugin.__init__, in order: (name, default). A user switches by changing imports only.
COLOSSALAI_SIGNATURE: list[tuple[str, Any]] = [
    ("tp_size", REQUIRED), ("pp_size", REQUIRED), ("ep_size", REQUIRED), ("sp_size", None), ("precision", "fp16"),
    ("zero_stage", 0), ("enable_all_optimization", False), ("enable_fused_normalization", False),
    ("enable_flash_attention", False), ("enable_jit_fused", False), ("enable_sequence_parallelism", False),
    ("sequence_parallelism_mode", None), ("enable_sequence_overlap", False), ("parallel_output", True),
    ("num_microbatches", None), ("microbatch_size", None), ("initial_scale", 2**16), ("min_scale", 1),
    ("growth_factor", 2), ("backoff_factor", 0.5), ("growth_interval", 1000), ("hysteresis", 2),
    ("max_scale", 2**32), ("max_norm", 0), ("broadcast_buffers", True), ("ddp_bucket_cap_mb", 25),
    ("find_unused_parameters", False), ("check_reduction", False), ("gradient_as_bucket_view", False),
    ("static_graph", False), ("zero_bucket_size_in_m", 12), ("cpu_offload", False), ("communication_dtype", None),
    ("overlap_communication", False), ("custom_policy", None), ("pp_style", "1f1b"), ("num_model_chunks", 1),
    ("num_layers_per_stage", None), ("gradient_checkpoint_config", None), ("enable_metadata_cache", True),
    ("make_vocab_size_divisible_by", 64), ("moe_dp_outside", True), ("overlap_p2p", True),
    ("overlap_allgather", False), ("fp8_communication", False), ("use_fp8", False),
]  # fmt: skip


# cx's additions, keyword-only after ColossalAI's parameters (a positional call means what it means there)
CX_ADDITIONS: dict[str, Any] = {"optimizer_states_dtype": "fp32", "fp8_recipe": ScalingRecipe.TENSORWISE}


def test_plugins_moe_hybrid_signature_matches_colossalai() -> None:
    parameters = list(inspect.signature(MoeHybridParallelPlugin.__init__).parameters.values())[1:]
    extra = {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert extra == CX_ADDITIONS
    positional = [p for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    ours = [(p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in positional]
    assert [name for name, _ in ours] == [name for name, _ in COLOSSALAI_SIGNATURE], "names or order differ"
    for (name, default), (_, expected) in zip(ours, COLOSSALAI_SIGNATURE, strict=True):
        assert default == expected or (default is REQUIRED and expected is REQUIRED), f"{name}: {default!r}"
