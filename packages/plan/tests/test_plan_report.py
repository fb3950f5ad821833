"""cx-plan's report: ranking (fitting by step time, then misses by peak), the table with each miss's reason, the
JSON for scripts, and the best's constructor call and cx-train command, which must parse with cx-train's parser."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from cx_plan._candidate import Candidate
from cx_plan._devices import lookup_device
from cx_plan._report import PlanReport, PlanRow, constructor_call, rank_rows, row_label, train_command
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace._model_spec import shape_from_config
from cx_plugins.models import GPTConfig


@dataclass(frozen=True)
class _Verdict:
    fits: bool
    peak_bytes: int
    reason: str = ""


def test_ranking_table_and_json() -> None:
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2))
    device = lookup_device("h100")
    verdicts = {
        Candidate("torch_ddp", dp=2, micro_batch_size=4): _Verdict(True, 3 * 10**9),
        Candidate("gemini", dp=2, micro_batch_size=4): _Verdict(True, 2 * 10**9),
        Candidate("hybrid", tp=2, micro_batch_size=4): _Verdict(False, 90 * 10**9, "activations 85 GB > 80 GB; try"),
        Candidate("low_level_zero", dp=2, micro_batch_size=4): _Verdict(False, 81 * 10**9, "optimizer states ..."),
        Candidate("hybrid", pp=2, num_microbatches=2, micro_batch_size=2): _Verdict(False, 0, "cx refuses: ..."),
        Candidate("gemini", dp=2, micro_batch_size=4, placement_policy="auto"): _Verdict(True, 2 * 10**9),
    }
    rows = [PlanRow(c, v, predict_step_time(c, shape, 32, device)) for c, v in verdicts.items()]
    ranked = rank_rows(rows)
    fitting = [r for r in ranked if r.memory.fits]
    assert [r.memory.fits for r in ranked] == [True, True, True, False, False, False]
    assert fitting[0].step.step_s <= fitting[1].step.step_s <= fitting[2].step.step_s
    # smaller peak first, the one cx refuses to build (no peak) last
    assert [r.candidate.plugin for r in ranked[3:]] == ["low_level_zero", "hybrid", "hybrid"]
    assert ranked[-1].candidate.pp == 2
    report = PlanReport("gpt", 2, 32, device, ranked)
    assert report.best is ranked[0]
    text = report.table()
    assert "6 candidates, 3 fit" in text
    assert "gemini dp2 mb4x1 bf16 auto" in text  # Gemini's placement tells the rows apart
    assert "activations 85 GB > 80 GB; try" in text
    assert f"best: {constructor_call(ranked[0].candidate)}" in text
    loaded = json.loads(json.dumps(report.as_json()))
    assert loaded["best"]["label"] == row_label(ranked[0].candidate)
    assert [r["fits"] for r in loaded["rows"]] == [True, True, True, False, False, False]
    assert loaded["rows"][0]["step_s"] == ranked[0].step.step_s
    assert loaded["rows"][0]["hidden_s"] == ranked[0].step.hidden_s  # what step_s left out of communication_s
    nothing = PlanReport("gpt", 2, 32, device, ranked[3:])
    assert nothing.best is None
    assert "nothing fits" in nothing.table()


def test_constructor_calls_and_cx_train_commands() -> None:
    hybrid = Candidate(
        "hybrid", dp=2, tp=2, pp=2, micro_batch_size=2, num_microbatches=4, zero_stage=1, checkpoint_ratio=1.0
    )
    assert constructor_call(hybrid) == (
        "HybridParallelPlugin(tp_size=2, pp_size=2, zero_stage=1, precision='bf16', num_microbatches=4, "
        "pp_style='1f1b', num_model_chunks=1, gradient_checkpoint_config=GradientCheckpointConfig("
        "gradient_checkpointing_ratio=1))"
    )
    assert "#" not in train_command(hybrid, "mixtral", 64, ("--hidden-size", "96", "--num-layers", "3"))
    zbv = Candidate("hybrid", pp=2, num_microbatches=2, pp_style="zbv", sp_mode="split_gather", tp=2)
    assert train_command(zbv, "gpt", 32).endswith("--tp 2 --pp 2 --zero 0 --pp-style zbv --sp-mode split_gather")
    offload = Candidate("gemini", dp=2, offload_optim_frac=1.0)
    assert "offload_optim_frac=1.0" in constructor_call(offload)
    assert train_command(offload, "gpt", 32).endswith("--offload-optim-fraction 1")


def test_equal_step_times_prefer_larger_micro_batches() -> None:
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2))
    device = lookup_device("h100")
    splits = [Candidate("torch_ddp", dp=2, micro_batch_size=m, num_microbatches=4 // m) for m in (1, 2, 4)]
    rows = [PlanRow(c, _Verdict(True, 10**9), predict_step_time(c, shape, 32, device)) for c in splits]
    assert rows[0].step.step_s == pytest.approx(rows[2].step.step_s, rel=1e-12)  # the model sees no difference
    assert [r.candidate.micro_batch_size for r in rank_rows(rows)] == [4, 2, 1]
