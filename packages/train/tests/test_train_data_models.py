"""cx-train --data with the other models the issue names: a tiny Mixtral (the `mixtral` preset on UTF-8 bytes, experts
split over two ranks by moe_hybrid) learns, reports a finite aux loss and expert balance on every --metrics line, and a
run resumed mid-epoch gives exactly the uninterrupted run's losses and parameters; so does the tiny Llama folder with
its own tokenizer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from cx_mesh.testing import run_distributed
from cx_train import parse_options
from cx_train._train import run
from cx_train.metrics._metrics_file import read_metrics
from train_data_helpers import TINY_GPT, assert_same_weights, tiny_llama_folder, write_jsonl, write_text


def _train(rank: int, world_size: int, flags: list[str], out: str) -> None:
    losses = run(parse_options(flags, world_size=world_size))
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def _losses(path: Path) -> list[float]:
    return [float(v) for v in json.loads(path.read_text())]


def _whole_and_resumed(tmp_path: Path, world_size: int, flags: list[str], stop: int, steps: int) -> list[float]:
    """The run of `steps` steps, and the same run stopped at `stop` and resumed to `steps`: the same losses and final
    parameters bit for bit (same plugin and world size: same batches, same arithmetic). Returns the uninterrupted
    run's losses."""
    parse_options([*flags, "--steps", str(steps)], world_size=world_size)  # tokenises once, as the launcher does
    ckpt = tmp_path / "ckpt"
    whole_flags = [*flags, "--steps", str(steps), "--save", str(tmp_path / "whole")]
    run_distributed(_train, world_size, flags=whole_flags, out=str(tmp_path / "whole.json"))
    stopped = [*flags, "--steps", str(stop), "--save", str(ckpt)]
    run_distributed(_train, world_size, flags=stopped, out=str(tmp_path / "a.json"))
    resumed = [*flags, "--steps", str(steps), "--resume", str(ckpt), "--save", str(tmp_path / "b")]
    run_distributed(_train, world_size, flags=resumed, out=str(tmp_path / "b.json"))
    whole = _losses(tmp_path / "whole.json")
    assert len(whole) == steps
    assert _losses(tmp_path / "a.json") + _losses(tmp_path / "b.json") == whole
    assert_same_weights(tmp_path / "whole", tmp_path / "b")
    return whole


def test_train_data_mixtral_learns_resumes_and_reports_experts(tmp_path: Path) -> None:
    data = write_text(tmp_path / "a.txt", 2000, seed=4)
    metrics = tmp_path / "metrics.jsonl"
    flags = [*TINY_GPT, "--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "2", "--nproc", "2"]
    flags += ["--batch-size", "2", "--data", str(data), "--log-every", "2"]
    whole = _whole_and_resumed(tmp_path, 2, [*flags, "--metrics", str(metrics)], stop=4, steps=10)
    assert sum(whole[-3:]) < sum(whole[:3]) - 3 * 0.5, whole  # ln 257 = 5.5 nats falls fast on repetitive text
    records = read_metrics(metrics)  # the uninterrupted run's lines, then the resumed run's (steps 6..10)
    assert [r["step"] for r in records] == [2, 4, 6, 8, 10], records
    for record in records:  # 4 experts, top 2: every token picks 2 distinct experts
        # num_experts * sum(token fraction * mean router probability): each fraction <= 1 and the probabilities sum
        # to 1, so 0 < aux <= 4 (2 when balanced)
        assert math.isfinite(record["aux_loss"]), record
        assert 0 < record["aux_loss"] <= 4, record
        # the busiest expert's tokens (<= all tokens) over the mean expert's (2 / 4 of the tokens): 1 <= it <= 2
        assert math.isfinite(record["expert_balance"]), record
        assert 1 <= record["expert_balance"] <= 2, record
        counts = torch.tensor(record["expert_counts"], dtype=torch.float64)  # [layers, experts]: cx-plan --expert-load
        assert counts.shape[1] == 4, record
        expected = counts.max(dim=1).values / counts.mean(dim=1)
        assert math.isclose(float(expected.max()), record["expert_balance"], rel_tol=1e-9), record


def test_train_data_llama_folder_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    folder = tiny_llama_folder(tmp_path / "llama")
    data = write_jsonl(tmp_path / "docs.jsonl", 60, seed=5)
    flags = ["--model", str(folder), "--data", str(data), "--seq-len", "32", "--batch-size", "2", "--lr", "3e-3"]
    flags += ["--plugin", "low_level_zero", "--log-every", "100"]
    _whole_and_resumed(tmp_path, 2, flags, stop=3, steps=7)
