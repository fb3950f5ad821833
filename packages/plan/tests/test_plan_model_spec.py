"""The planner's model reading: parameter counts from the built model, clear errors for unusable configs, and the
Candidate's validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cx_plan import Candidate, ModelShapeError, load_model_shape, trace_stage


def test_deepseek_first_layer_dense_then_moe() -> None:
    counts = load_model_shape("deepseek_v3", hidden_size=32, num_layers=2, seq_len=16).parameters
    assert counts.experts_per_layer[0] == 0
    assert counts.experts_per_layer[1] > 0


def test_config_json_llama_8b_counts(tmp_path: Path) -> None:
    fields = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, intermediate_size=14336)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    shape = load_model_shape(str(tmp_path))
    # Llama 3 8B's published count: 8,030,261,248 parameters (untied 128256 x 4096 embedding and head)
    assert shape.parameters.total == 8_030_261_248
    assert shape.parameters.embeddings == 2 * 128256 * 4096
    assert (shape.num_kv_heads, shape.head_dim) == (8, 128)
    assert shape.parameters.dense_per_layer[0] == 218_112_000


def test_missing_fields_are_named(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 64}))
    with pytest.raises(ModelShapeError, match=r"num_hidden_layers.*num_attention_heads"):
        load_model_shape(str(config))
    config.write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(ModelShapeError, match=r"model_type.*hidden_size"):
        load_model_shape(str(config))
    with pytest.raises(ModelShapeError, match=r"no config.json"):
        load_model_shape(str(tmp_path / ".."))
    with pytest.raises(ModelShapeError, match="neither a built-in model"):
        load_model_shape("no-such-model")


# configs transformers refuses to make (a validator) or to build (an unknown rope type): one line each, not a traceback
REJECTED = {"hidden_size": 30}
UNBUILDABLE = {"rope_scaling": {"rope_type": "nonsense"}}
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 64, "max_position_embeddings": 128}  # fmt: skip


def test_configs_transformers_rejects_are_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA, **REJECTED}))
    with pytest.raises(
        ModelShapeError, match=r"transformers rejects this config: .*hidden size \(30\) is not a multiple"
    ):
        load_model_shape(str(config))
    config.write_text(json.dumps({**LLAMA, **UNBUILDABLE}))
    with pytest.raises(
        ModelShapeError, match=r"transformers cannot build a model of this config: KeyError: 'nonsense'"
    ):
        load_model_shape(str(config))


def test_candidate_validates_and_derives() -> None:
    candidate = Candidate("moe_hybrid", dp=4, ep=2, tp=2, pp=2, num_microbatches=4, micro_batch_size=2)
    assert (candidate.world_size, candidate.moe_dp, candidate.global_batch_size) == (16, 2, 32)
    assert candidate.plugin_arguments()["ep_size"] == 2
    assert Candidate("gemini").stage == 3
    assert Candidate("low_level_zero").stage == 2
    assert Candidate("hybrid", tp=2, sp_mode="split_gather").sequence_split == 2
    assert Candidate("hybrid", pp=2, num_microbatches=1).num_microbatches == 1  # 1F1B runs one (cx-train allows it)
    for bad, match in [
        (dict(plugin="torch_ddp", tp=2), "data parallelism only"),
        (dict(plugin="gemini", tp=2, pp=2), "tensor parallelism \\(tp_size\\) at most"),
        (dict(plugin="hybrid", ep=2, dp=2), "moe_hybrid"),
        (dict(plugin="hybrid", pp=4, num_microbatches=2, pp_style="interleaved"), "a multiple of pp=4"),
        (dict(plugin="hybrid", sp=2), "sp_mode"),
        (dict(plugin="low_level_zero", zero_stage=3), "stage 1 or 2"),
        (dict(plugin="hybrid", checkpoint_ratio=1.5), "checkpoint_ratio"),
        (dict(plugin="nope"), "unknown plugin"),
    ]:
        with pytest.raises(ValueError, match=match):
            Candidate(**bad)  # type: ignore[arg-type]


def test_a_tied_head_is_traced_as_one_parameter() -> None:
    """The trace keeps a tied LM head one parameter with its embedding: replaced slot by slot, it became two and the
    embedding's states were counted twice (Qwen2.5-3B: 311M elements, 10 % of the model)."""
    shape = load_model_shape("gpt")
    assert shape.parameters.tied
    trace = trace_stage(shape, Candidate("torch_ddp", precision="fp32"), 64)
    assert trace.parameter_count == shape.parameters.total
    assert trace.parameter_bytes == 4 * shape.parameters.total
