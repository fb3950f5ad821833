"""`cx-train --max-restarts N`: a rank killed mid-run (SIGKILL, as an OOM killer does) and the run finishes by itself.
torchrun restarts the ranks, they resume from the latest checkpoint in --save, and the run's metrics file holds
every step once, with the losses of an uninterrupted run: steps before the checkpoint as logged, steps after it
trained again from the same weights, moments, schedule and data position (same machine, same kernels: equal to
fp32 rounding; 1e-5 relative is far below a wrong data position's or step's effect, 1e-2 and more)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cx_train import parse_options
from cx_train.checkpoint._restart import RESTART_VARIABLE, restarted
from test_train_launcher_death import _alive, _children

STEPS = 120  # enough left after the kill at step 12 that a fast machine cannot finish the run before it
FLAGS = ["--nproc", "2", "--steps", str(STEPS), "--log-every", "1", "--batch-size", "2", "--seq-len", "16",
         "--hidden-size", "32", "--lr", "1e-2", "--save-every", "8"]  # fmt: skip
WAIT_S = 300.0


def _losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def _cx_train(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    flags = [*FLAGS, "--save", str(tmp_path / name), "--metrics", str(tmp_path / f"{name}.jsonl"), *extra]
    output = (tmp_path / f"{name}.out").open("w")
    return subprocess.Popen([sys.executable, "-m", "cx_train", *flags], env=env, stdout=output, stderr=output)


def test_train_restart_after_a_killed_rank_resumes_and_finishes(tmp_path: Path) -> None:
    straight = _cx_train(tmp_path, "straight")
    assert straight.wait(timeout=WAIT_S) == 0, (tmp_path / "straight.out").read_text()[-3000:]
    launcher = _cx_train(tmp_path, "restarted", "--max-restarts", "1")
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while "step 12/" not in (tmp_path / "restarted.out").read_text():  # past the step-8 checkpoint
            assert launcher.poll() is None, (tmp_path / "restarted.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 12"
            time.sleep(0.2)
        ranks = sorted(pid for pid in _children(launcher.pid) if _alive(pid))
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        assert launcher.wait(timeout=WAIT_S) == 0, (tmp_path / "restarted.out").read_text()[-3000:]
    finally:
        for pid in [launcher.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    printed = (tmp_path / "restarted.out").read_text()
    assert "cx-train: restart 1 of 1 after a rank failed: resuming from the checkpoint in" in printed, printed[-3000:]
    said = re.search(r"at step (\d+); the failed run had reached step (\d+), (\d+) step\(s\) redone", printed)
    assert said is not None, printed[-3000:]
    resumed, reached, redone = (int(v) for v in said.groups())
    assert resumed >= 8, said.group(0)
    assert resumed % 8 == 0, said.group(0)  # a --save-every checkpoint
    assert reached - resumed == redone >= 0, said.group(0)
    want, got = _losses(tmp_path / "straight.jsonl"), _losses(tmp_path / "restarted.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got[step], want[step])
    assert json.loads((tmp_path / "restarted" / "trainer.json").read_text())["step"] == STEPS


def test_train_restart_flag_and_config_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--max-restarts` needs `--save` (a restart resumes from it) and is a config key like every flag; a restarted
    rank (torchrun's TORCHELASTIC_RESTART_COUNT) resumes from --save once it holds a checkpoint, else from the start."""
    config = tmp_path / "run.toml"
    config.write_text(f'max_restarts = 2\nsave = "{tmp_path / "ckpt"}"\n')
    options = parse_options(["--config", str(config)])
    assert (options.max_restarts, options.save) == (2, tmp_path / "ckpt")
    with pytest.raises(SystemExit):
        parse_options(["--max-restarts", "1"])
    assert "--max-restarts needs --save DIR" in capsys.readouterr().err
    assert restarted(options) is options  # the first start: nothing changes
    monkeypatch.setenv(RESTART_VARIABLE, "1")
    assert restarted(options).resume is None  # nothing saved yet: from the start
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainer.json").write_text("{}")
    assert restarted(options).resume == tmp_path / "ckpt"
    assert restarted(options).restart == 1
