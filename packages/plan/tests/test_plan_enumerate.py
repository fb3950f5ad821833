"""cx-plan's candidate enumeration: every plugin's layouts obey the divisibility rules the plugins and shard policies
check, the global batch stays fixed, and a world no layout splits raises an error naming why per plugin."""

from __future__ import annotations

import pytest

from cx_plan._candidate import Candidate
from cx_plan._enumerate import NoLayoutError, SearchSpace, enumerate_candidates
from cx_plan._report import row_label
from cx_plan.trace._model_spec import ModelShape, ParameterCounts, shape_from_config
from cx_plugins.models import GPTConfig

_SEQ = 32
_GPT = GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2, num_heads=2)


def _moe(heads: int = 8, kv: int = 2, experts: int = 4, layers: int = 4) -> ModelShape:
    counts = ParameterCounts(1000, 100, 100, (200,) * layers, (400,) * layers, 100, False)
    return ModelShape("moe", "mixtral", 100, 64, layers, heads, kv, 64 // heads, 96, experts, 2, 64, counts, None)


def test_enumeration_obeys_the_layout_rules() -> None:
    shape = _moe()
    world = 8
    found = enumerate_candidates(shape, world, _SEQ, SearchSpace(global_batch=16))
    assert {c.plugin for c in found} == {"torch_ddp", "torch_fsdp", "low_level_zero", "gemini", "hybrid", "moe_hybrid"}
    assert len(set(found)) == len(found)  # no duplicates
    labels = [row_label(c) for c in found]
    assert len(set(labels)) == len(labels), "two candidates share a report row label"
    for c in found:
        assert c.world_size == world
        assert c.global_batch_size == 16  # every candidate trains the same tokens per step
        assert shape.num_heads % c.tp == 0
        assert shape.num_kv_heads % c.tp == 0
        assert 96 % c.tp == 0
        assert shape.num_experts % c.ep == 0
        assert c.pp * c.num_model_chunks <= shape.num_layers
        if c.sp_mode == "all_to_all":
            assert (shape.num_kv_heads // c.tp) % c.sp == 0
        if c.sp_mode == "ring_attn":
            assert _SEQ % (2 * c.sp) == 0
        if c.pp_style == "interleaved":
            assert c.num_microbatches % c.pp == 0
        if c.pp > 1:
            assert c.num_microbatches >= c.pp
    tps = {c.tp for c in found}
    assert tps == {1, 2}  # 2 key/value heads: tp 4 and 8 do not divide them
    assert {c.ep for c in found if c.plugin == "moe_hybrid"} == {1, 2, 4}  # 4 experts: never ep 8
    assert any(c.sp_mode == "all_to_all" and c.sp == 2 for c in found)
    assert any(c.sp_mode == "ring_attn" and c.sp == 8 for c in found)
    assert any(c.pp_style == "zbv" and c.pp == 2 for c in found)
    assert not any(c.pp_style == "zbv" and c.pp == 4 for c in found)  # 4 layers: no two chunks on 4 stages
    gemini = {(c.placement_policy, c.offload_optim_frac) for c in found if c.plugin == "gemini"}
    assert gemini == {("static", 0.0), ("static", 1.0), ("auto", 0.0)}
    # GeminiPlugin's tp_size: ShardFormer over tp (dividing the heads as above), Gemini over dp = world / tp, no pp
    assert {(c.tp, c.dp, c.pp, c.sp) for c in found if c.plugin == "gemini"} == {(1, 8, 1, 1), (2, 4, 1, 1)}
    assert {c.stage for c in found if c.plugin == "low_level_zero"} == {1, 2}


def test_search_space_limits_and_dense_models() -> None:
    gpt = shape_from_config(
        "gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2, num_heads=2)
    )
    found = enumerate_candidates(gpt, 2, _SEQ, SearchSpace(plugins=("hybrid", "moe_hybrid"), checkpoint_ratios=(0.5,)))
    assert {c.plugin for c in found} == {"hybrid"}  # no experts, no moe_hybrid
    assert {c.checkpoint_ratio for c in found} == {0.5}
    assert {c.global_batch_size for c in found} == {8}  # default: 4 sequences per rank


def test_no_layout_errors_name_the_reason() -> None:
    gpt = shape_from_config(
        "gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2, num_heads=2)
    )
    with pytest.raises(NoLayoutError) as caught:
        enumerate_candidates(gpt, 7, _SEQ, SearchSpace(global_batch=8))
    message = str(caught.value)
    assert "no configuration splits 7 ranks for gpt (global batch 8)" in message
    assert "torch_ddp: the global batch 8 does not split over dp=7" in message
    assert "tp=7 does not divide the 2 attention heads" in message
    assert "pp=7 exceeds the 2 layers" in message
    assert "moe_hybrid: gpt has no routed experts" in message
    with pytest.raises(NoLayoutError, match="unknown plugin"):
        enumerate_candidates(gpt, 2, _SEQ, SearchSpace(plugins=("deepspeed",)))
    with pytest.raises(NoLayoutError, match="positive number of devices"):
        enumerate_candidates(gpt, 0, _SEQ)


def test_data_parallel_plugins_checkpoint_all_or_none_and_gemini_does_not_accumulate() -> None:
    # the trace checkpoints every layer under them (transformers' switch), so a ratio of 0.5 would be predicted as
    # 1 and timed as 0.5; GeminiDDP refuses accumulation (and cx-train --grad-accum with gemini)
    gpt = shape_from_config(
        "gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2, num_heads=2)
    )
    space = SearchSpace(checkpoint_ratios=(0.0, 0.5, 1.0), global_batch=8)
    found = enumerate_candidates(gpt, 2, _SEQ, space)
    for plugin in ("torch_ddp", "torch_fsdp", "low_level_zero", "gemini"):
        assert {c.checkpoint_ratio for c in found if c.plugin == plugin} == {0.0, 1.0}
    assert 0.5 in {c.checkpoint_ratio for c in found if c.plugin == "hybrid"}
    assert {c.num_microbatches for c in found if c.plugin == "gemini"} == {1}
    assert {c.num_microbatches for c in found if c.plugin == "low_level_zero"} == {1, 2, 4}
    with pytest.raises(NoLayoutError, match="checkpoints all layers or none"):
        enumerate_candidates(gpt, 2, _SEQ, SearchSpace(plugins=("torch_ddp",), checkpoint_ratios=(0.5,)))
    with pytest.raises(ValueError, match="whole model or nothing"):
        Candidate("low_level_zero", checkpoint_ratio=0.5)
    with pytest.raises(ValueError, match="gemini runs one micro-batch"):
        Candidate("gemini", num_microbatches=2)


def test_gemini_at_tp_checkpoints_full_layers_only() -> None:
    """Nothing runs torchtitan's selective op policy around ShardFormer's tp layers (cx-train refuses it for hybrid
    and gemini at tp > 1), so Gemini's tp > 1 layouts take full checkpointing only; at tp 1 both modes stay."""
    gpt = shape_from_config("gpt", _GPT)
    space = SearchSpace(global_batch=8, max_tp=2, checkpoint_modes=("full", "selective-op"))
    gemini = [c for c in enumerate_candidates(gpt, 4, _SEQ, space) if c.plugin == "gemini"]
    assert {(c.tp, c.checkpoint_mode) for c in gemini} == {(1, "full"), (1, "selective-op"), (2, "full")}
    assert Candidate("gemini", dp=2, tp=2, checkpoint_ratio=1.0).tp == 2
    with pytest.raises(ValueError, match="op policy around ShardFormer's tp layers"):
        Candidate("gemini", dp=2, tp=2, checkpoint_ratio=1.0, checkpoint_mode="selective-op")
