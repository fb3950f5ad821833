"""The cx-train demo: its data, its flags, and a real multi-process run whose loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cx_mesh.testing import sum_tolerance
from cx_train import CharTokenizer, GrammarText, TokenWindows, parse_options
from cx_train.config._parser import DEFAULT_HIDDEN, DEFAULT_LAYERS
from cx_train.metrics._metrics_file import read_metrics


def test_train_data_is_deterministic_and_round_trips() -> None:
    text = GrammarText(seed=3).generate(500)
    assert text == GrammarText(seed=3).generate(500)
    assert text != GrammarText(seed=4).generate(500)
    tokenizer = CharTokenizer()
    assert tokenizer.decode(tokenizer.encode(text)) == text
    windows = TokenWindows(n_windows=10, length=17)
    assert len(windows) == 10
    assert windows[3].shape == (17,)
    assert int(windows[3].max()) < tokenizer.vocab_size
    assert torch.equal(windows[3], TokenWindows(n_windows=10, length=17)[3])


def test_train_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["--nproc", "0"], "must be a positive integer"),
        (["--plugin", "nope"], "invalid choice: 'nope'"),
        (["--lr", "-1"], "must be positive"),
        (["--hidden-size", "30"], "multiple of 4"),
    ]:
        with pytest.raises(SystemExit) as caught:
            parse_options(argv)
        assert caught.value.code == 2
        assert message in capsys.readouterr().err


def _cx_train(*flags: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [sys.executable, "-m", "cx_train", "--log-every", "20", *flags]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def _loss_change(output: str) -> tuple[float, float]:
    match = re.search(r"cx-train: loss ([0-9.]+) -> ([0-9.]+)", output)
    assert match, output
    return float(match.group(1)), float(match.group(2))


def test_train_trains_saves_and_resumes_under_another_plugin_and_world_size(tmp_path: Path) -> None:
    first_run = _cx_train("--steps", "60", "--save", str(tmp_path / "ckpt"), "--save-every", "40")
    assert "ranks=2" in first_run
    assert "step 60/60" in first_run
    assert "saved step 40" in first_run
    start, end = _loss_change(first_run)
    assert end < start - 0.5, f"loss did not fall enough: {start} -> {end}"
    assert (tmp_path / "ckpt" / "trainer.json").is_file()
    assert (tmp_path / "ckpt" / "model" / "model.safetensors.index.json").is_file() or (
        tmp_path / "ckpt" / "model" / "model.safetensors"
    ).is_file()

    resumed = _cx_train(
        "--steps", "90", "--nproc", "1", "--plugin", "low_level_zero", "--resume", str(tmp_path / "ckpt")
    )
    assert "ranks=1" in resumed
    assert "resumed from" in resumed
    assert "at step 60" in resumed
    assert "step 90/90" in resumed
    resumed_start, _ = _loss_change(resumed)
    assert resumed_start < start - 0.5, "the resumed run must start from the trained weights, not from scratch"


def test_train_muon_trains_and_resumes_at_another_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--optimizer muon (cx-zero's MuonWithAdamW) under low_level_zero at 2 ranks trains, saves its state (each
    matrix's momentum, the AdamW moments) and resumes it at 1 rank; --optimizer adamw cannot resume it."""
    flags = ("--plugin", "low_level_zero", "--optimizer", "muon", "--lr", "3e-3", "--log-every", "10")
    first = _cx_train(*flags, "--steps", "30", "--save", str(tmp_path / "ckpt"))
    assert "ranks=2" in first
    start, end = _loss_change(first)
    assert end < start - 0.5, f"loss did not fall enough: {start} -> {end}"
    resumed = _cx_train(*flags, "--steps", "50", "--nproc", "1", "--resume", str(tmp_path / "ckpt"))
    assert "at step 30" in resumed
    assert "step 50/50" in resumed
    resumed_start, _ = _loss_change(resumed)
    assert resumed_start < start - 0.5, "the resumed run must start from the trained weights, not from scratch"
    with pytest.raises(SystemExit):  # Adam cannot load Muon's state: refused before any rank starts
        parse_options(["--steps", "50", "--plugin", "low_level_zero", "--resume", str(tmp_path / "ckpt")])
    assert "pass --optimizer muon" in capsys.readouterr().err


def test_train_muon_under_moe_hybrid_trains_and_resumes_at_ep_1(tmp_path: Path) -> None:
    """--optimizer muon under moe_hybrid (ep 2, ZeRO-1; each expert of the fused stacks orthogonalised on its own)
    trains, saves (the expert stacks' momentum gathered over ep) and resumes at 1 rank, ep 1."""
    flags = ("--model", "mixtral", "--plugin", "moe_hybrid", "--optimizer", "muon", "--lr", "3e-3", "--log-every", "10")
    first = _cx_train(*flags, "--ep", "2", "--zero", "1", "--steps", "30", "--save", str(tmp_path / "ckpt"))
    assert "ranks=2" in first
    start, end = _loss_change(first)
    assert end < start - 0.5, f"loss did not fall enough: {start} -> {end}"
    resumed = _cx_train(*flags, "--steps", "50", "--nproc", "1", "--resume", str(tmp_path / "ckpt"))
    assert "at step 30" in resumed
    assert "step 50/50" in resumed
    resumed_start, _ = _loss_change(resumed)
    assert resumed_start < start - 0.5, "the resumed run must start from the trained weights, not from scratch"


def test_train_muon_under_moe_hybrid_at_tp_2_trains_and_resumes_at_tp_1(tmp_path: Path) -> None:
    """--optimizer muon under moe_hybrid at tp 2, ZeRO 0 (the tp-split matrices stepped whole on tp owners, the
    experts replicated over tp) trains, saves (each rank's slice of the owners' momentum) and resumes at 1 rank."""
    flags = ("--model", "mixtral", "--plugin", "moe_hybrid", "--optimizer", "muon", "--lr", "3e-3", "--log-every", "10")
    first = _cx_train(*flags, "--tp", "2", "--steps", "30", "--save", str(tmp_path / "ckpt"))
    assert "ranks=2" in first
    start, end = _loss_change(first)
    assert end < start - 0.5, f"loss did not fall enough: {start} -> {end}"
    resumed = _cx_train(*flags, "--steps", "50", "--nproc", "1", "--resume", str(tmp_path / "ckpt"))
    assert "at step 30" in resumed
    assert "step 50/50" in resumed
    resumed_start, _ = _loss_change(resumed)
    assert resumed_start < start - 0.5, "the resumed run must start from the trained weights, not from scratch"


def test_train_gemini_at_tp_2_gives_the_tp_1_losses(tmp_path: Path) -> None:
    """`--plugin gemini --tp 2` (GeminiPlugin(tp_size=2): ShardFormer over the 2 ranks, Gemini over dp 1) trains the
    run tp 1 makes on one rank: the same seed, weights and batches (tp ranks share their data), fp32. Only the
    summation order differs: each of a step's 2 x layers row-parallel matmuls and its vocabulary-parallel loss sums
    its <= 4 x hidden terms in two halves, each such reordering moving the loss by at most `sum_tolerance` of
    4 x hidden terms of the loss's size, and Adam carries every step's difference into the next weights (so step s
    allows s of them). A wrong batch, weight slice or update moves the loss by 1e-2 or more."""
    losses = {}
    for tp, nproc in ((1, 1), (2, 2)):
        metrics = tmp_path / f"tp{tp}.jsonl"
        flags = ["--plugin", "gemini", "--nproc", str(nproc), "--steps", "4", "--metrics", str(metrics)]
        output = _cx_train(*flags, *(["--tp", "2"] if tp > 1 else []), "--log-every", "1")
        assert f"ranks={nproc}" in output
        losses[tp] = {record["step"]: record["loss"] for record in read_metrics(metrics)}
    assert sorted(losses[2]) == sorted(losses[1]) == [1, 2, 3, 4]
    hidden, layers = DEFAULT_HIDDEN, DEFAULT_LAYERS
    for step, expected in losses[1].items():
        reorderings = step * (2 * layers + 1)
        tolerance = reorderings * sum_tolerance(n_terms=4 * hidden, magnitude=expected)
        assert abs(losses[2][step] - expected) <= tolerance, (step, losses[2][step], expected, tolerance)
    assert losses[1][4] < losses[1][1] - 0.3  # it trains


def test_train_refuses_an_incomplete_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_options(["--resume", str(tmp_path)])
    assert "not a complete cx-train checkpoint" in capsys.readouterr().err


def test_train_hybrid_trains_saves_and_resumes_at_another_layout(tmp_path: Path) -> None:
    """`cx-train --plugin hybrid` at tp 2 saves a checkpoint (TP shards gathered); pipeline parallelism at pp 2 (its
    loss reported from the last stage) resumes from it and keeps training; the loss falls."""
    first = _cx_train("--plugin", "hybrid", "--steps", "60", "--tp", "2", "--save", str(tmp_path / "ckpt"))
    assert "plugin=hybrid" in first
    assert "step 60/60" in first
    start, end = _loss_change(first)
    assert end < start - 0.5, f"loss did not fall enough: {start} -> {end}"
    resumed = _cx_train("--plugin", "hybrid", "--steps", "80", "--pp", "2", "--resume", str(tmp_path / "ckpt"))
    assert "at step 60" in resumed
    assert "step 80/80" in resumed
    resumed_start, _ = _loss_change(resumed)
    assert resumed_start < start - 0.5, "the resumed run must start from the trained weights, not from scratch"


def test_train_hybrid_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--plugin", "low_level_zero", "--tp", "2"], "--tp applies to --plugin hybrid, moe_hybrid or gemini only"),
        (["--plugin", "hybrid", "--tp", "3"], "2 processes do not split into tp 3 x pp 1 x sp 1 = 3"),
        (["--plugin", "hybrid", "--pp", "2", "--num-layers", "1"], "layers do not split into 2 stages"),
    ):
        with pytest.raises(SystemExit):
            parse_options(argv)
        assert message in capsys.readouterr().err
