"""`cx-train --plan` (the same as --dry-run): the run's flags become the planner's Candidate, and the report prints
cx-plan's memory and step-time prediction for exactly that configuration; with --data, the start's data line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cx_plan import (
    Candidate,
    Optimizer,
    detect_device,
    format_bytes,
    load_model_shape,
    memory_model,
    memory_per_rank,
    predict_step_time,
)
from cx_train import main
from cx_train.config._options import parse_options
from cx_train.data._user_data import DataSettings, open_user_data
from cx_train.models._plugins import plan_candidate
from train_data_helpers import chat_record, tiny_chat_llama_folder


def test_cx_train_flags_become_the_planners_candidate() -> None:
    hybrid = parse_options(["--plugin", "hybrid", "--tp", "2", "--pp", "2", "--nproc", "8", "--batch-size", "8"])
    assert plan_candidate(hybrid, 8) == Candidate(
        "hybrid", dp=2, tp=2, pp=2, zero_stage=0, micro_batch_size=4, num_microbatches=2, precision="fp32"
    )
    zero = parse_options(["--plugin", "low_level_zero", "--precision", "bf16", "--grad-accum", "3", "--nproc", "2"])
    assert plan_candidate(zero, 2) == Candidate(
        "low_level_zero", dp=2, zero_stage=2, micro_batch_size=8, num_microbatches=3, precision="bf16"
    )
    flags = ["--plugin", "moe_hybrid", "--model", "mixtral", "--ep", "2", "--sp", "2", "--zero", "1", "--nproc", "4"]
    moe = plan_candidate(parse_options([*flags, "--activation-checkpointing"]), 4)
    assert (moe.dp, moe.ep, moe.moe_dp, moe.sp, moe.sp_mode, moe.stage) == (2, 2, 1, 2, "all_to_all", 1)
    assert moe.checkpoint_ratio == 1.0
    flags = ["--plugin", "torch_fsdp", "--model", "llama", "--activation-checkpointing-mode", "selective-op"]
    fsdp = plan_candidate(parse_options([*flags, "--nproc", "2"]), 2)  # what cx-train runs: per block, the op policy
    assert (fsdp.fsdp_wrap, fsdp.checkpoint_ratio, fsdp.checkpoint_mode) == ("block", 1.0, "selective-op")
    for name, optimizer in (("muon", Optimizer.MUON), ("fused_adam", Optimizer.ADAMW), ("adamw", Optimizer.ADAMW)):
        flags = ["--plugin", "low_level_zero", "--optimizer", name, "--nproc", "2"]  # the fused Adams: AdamW's states
        assert plan_candidate(parse_options(flags), 2).optimizer is optimizer


def test_cx_train_plan_of_muon_counts_its_states_and_gathers(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--plugin", "low_level_zero", "--nproc", "2", "--seq-len", "32", "--hidden-size", "32", "--plan"]
    assert main([*argv, "--optimizer", "muon"]) == 0
    muon = capsys.readouterr().out
    assert "muon gradient gather" in muon
    assert "muon weight scatter" in muon
    assert main(argv) == 0
    assert "muon" not in capsys.readouterr().out.split("# parallel layout")[1]


def test_cx_train_plan_prints_the_prediction(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--plugin", "hybrid", "--tp", "2", "--pp", "2", "--nproc", "4", "--seq-len", "32", "--hidden-size", "32"]
    argv.append("--plan")
    assert main(argv) == 0
    out = capsys.readouterr().out
    options = parse_options(argv)
    shape = load_model_shape("gpt", hidden_size=options.hidden_size, num_layers=options.num_layers, seq_len=32)
    step = predict_step_time(plan_candidate(options, 4), shape, 32, detect_device())
    assert f"# predicted step on 4 x {detect_device().name} (cx-plan, 45% of peak): {step.step_s * 1e3:.2f} ms" in out
    assert "tp activation all-reduce" in out
    assert "pipeline bubble" in out
    # the memory figures are the planner's model (one memory model): a traced peak with activations, not a formula
    device = detect_device()
    per_rank = memory_per_rank(device, 4)  # on the CPU: the host's memory shared by the 4 ranks
    assert per_rank == (device.memory_bytes // 4 if device.name == "cpu" else device.memory_bytes)
    verdict = memory_model(shape, 32, per_rank, host_is_device=device.name == "cpu")(plan_candidate(options, 4))
    assert f"#   on {device.name} ({format_bytes(per_rank)}" in out
    assert f"activations {format_bytes(verdict.prediction.activations)}" in out
    assert f"; peak {format_bytes(verdict.peak_bytes)}\n" in out
    assert "fits" in out
    assert "estimate without activations" not in out


def test_cx_train_dry_run_of_gemini_at_tp_2(capsys: pytest.CaptureFixture[str]) -> None:
    """--plugin gemini --tp 2 launches as GeminiPlugin(tp_size=2): the planner's tp candidate, the plugin's
    (dp, tp) mesh with tp innermost, and the tp activation all-reduces in the predicted step."""
    argv = ["--plugin", "gemini", "--tp", "2", "--nproc", "4", "--seq-len", "32", "--hidden-size", "32"]
    candidate = plan_candidate(parse_options(argv), 4)
    assert candidate == Candidate("gemini", dp=2, tp=2, micro_batch_size=8, precision="fp32")
    assert candidate.plugin_arguments()["tp_size"] == 2
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#   rank 1: dp=0 tp=1\n#   rank 2: dp=1 tp=0\n" in out
    assert "tp activation all-reduce" in out
    assert "fits" in out


def test_cx_train_dry_run_prints_the_data_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With --data, --dry-run prints the data line the real start prints: windows, documents, chats packed whole and
    the --overlong counts (one chat longer than the window, truncated)."""
    folder = tiny_chat_llama_folder(tmp_path / "model")
    long = {"messages": [{"role": "user", "content": "the cat sees the moon . " * 12}, *chat_record(4)["messages"]]}
    records = [chat_record(2), chat_record(4), long, chat_record(6)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(record) + "\n" for record in records))
    flags = ["--model", str(folder), "--data", str(data), "--seq-len", "31", "--batch-size", "1", "--nproc", "1"]
    assert main([*flags, "--overlong", "truncate", "--dry-run"]) == 0
    out = capsys.readouterr().out
    expected = open_user_data(DataSettings((str(data),), overlong="truncate"), str(folder), True, 32).summary()
    assert "from 4 documents, 4 of them chats (chats packed whole; 1 documents truncated, 0 dropped" in expected
    assert f"# {expected}\n" in out
