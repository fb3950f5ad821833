"""`python -m cx_train` on chat data end to end: a Llama folder with a chat template, a small chat JSONL, packed whole
with masked prompts; the run trains and evaluates, and a run stopped and resumed is the uninterrupted run exactly (two
processes, torch DDP), and one process continues the same checkpoint on the same global batches.

One launcher start (the uninterrupted run, the CLI end to end); the stopped run, its resumption and the one-process
continuation run the same `cx_train._train.run` on the test harness's pooled ranks (one thread each, as the launched
ranks under OMP_NUM_THREADS=1): no torch import per run, the same arithmetic, so the losses compare bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from cx_mesh.testing import run_distributed, sum_tolerance
from cx_train import _train, parse_options
from cx_train.metrics._metrics_file import read_metrics
from train_data_helpers import assert_same_weights, tiny_chat_llama_folder, write_chat_jsonl


def _flags(tmp_path: Path) -> list[str]:
    folder = tiny_chat_llama_folder(tmp_path / "model")
    data = write_chat_jsonl(tmp_path / "chats.jsonl", 40)
    flags = ["--model", str(folder), "--data", str(data), "--seq-len", "63", "--lr", "1e-2", "--batch-size", "2"]
    return [*flags, "--plugin", "torch_ddp", "--nproc", "2", "--eval-fraction", "0.1", "--eval-every", "3"]


def _cx_train(tmp_path: Path, name: str, *flags: str) -> list[float]:
    """Run cx-train through its launcher; the loss of each step (its --metrics file)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    metrics = tmp_path / f"{name}.jsonl"
    command = [sys.executable, "-m", "cx_train", "--log-every", "1", "--metrics", str(metrics), *flags]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "chats packed whole" in result.stdout, result.stdout
    return [float(record["loss"]) for record in read_metrics(metrics)]


def _stopped_and_resumed(rank: int, world_size: int, flags: list[str], folder: str, whole: list[float]) -> None:
    """Steps 1-4 saved, then a second run resumed from them to step 8: its losses are the whole run's, bit for bit."""
    first = _train.run(parse_options([*flags, "--steps", "4", "--save", f"{folder}/half"], world_size=world_size))
    resume = [*flags, "--steps", "8", "--resume", f"{folder}/half", "--save", f"{folder}/resumed"]
    second = _train.run(parse_options(resume, world_size=world_size))
    assert first + second == whole, (first, second, whole)  # the same packed windows in order, the same arithmetic


def _alone(rank: int, world_size: int, flags: list[str], folder: str, whole: list[float]) -> None:
    """One process, the same global batch of 4 windows: its first step is the two ranks' step 5 on the same windows,
    its loss the same token mean taken in another order (the sum of the step's target-token losses, regrouped)."""
    resume = [*flags, "--steps", "8", "--resume", f"{folder}/half", "--nproc", "1", "--batch-size", "4"]
    alone = _train.run(parse_options(resume, world_size=world_size))
    assert len(alone) == 4
    targets = 4 * 64  # at most: the step's windows' tokens
    assert abs(alone[0] - whole[4]) <= sum_tolerance(n_terms=targets, magnitude=whole[4]), (alone[0], whole[4])


def test_train_chat_run_trains_and_resumes_exactly(tmp_path: Path) -> None:
    flags = _flags(tmp_path)
    whole = _cx_train(tmp_path, "whole", *flags, "--steps", "8", "--save", str(tmp_path / "whole"))
    assert len(whole) == 8
    assert sum(whole[-2:]) < sum(whole[:2]), whole
    run_distributed(_stopped_and_resumed, 2, flags=flags, folder=str(tmp_path), whole=whole)
    assert_same_weights(tmp_path / "whole", tmp_path / "resumed")
    run_distributed(_alone, 1, flags=flags, folder=str(tmp_path), whole=whole)
