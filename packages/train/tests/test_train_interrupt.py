"""Ctrl-C on cx-train stops every rank cleanly: one line saying the step reached and what was saved, exit status 130,
a complete checkpoint and no staging directory left behind (it printed some 165 lines of tracebacks from every rank
and gloo before)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cx_checkpoint import VerifyOutcome, verify_checkpoints

FIRST_STEP_S = 900.0  # seconds to the first progress line: a few here, over 10 minutes once in a starved CI run


@pytest.mark.skipif(sys.platform == "win32", reason="process groups and SIGINT are POSIX")
def test_train_interrupt_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "cx_train", "--nproc", "2", "--plugin", "torch_ddp", "--steps", "100000",
        "--batch-size", "2", "--seq-len", "16", "--hidden-size", "32", "--log-every", "1",
        "--save", str(save), "--save-every", "1",  # a save every step: the interrupt most likely lands in one
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    # a launcher that never prints (starved on a loaded machine, or stuck) must fail the test, not hang it
    watchdog = threading.Timer(FIRST_STEP_S, lambda: os.killpg(process.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:  # the first progress line: the ranks are training
            if "] step " in line:
                break
        else:
            pytest.fail(f"cx-train ended before training: {process.stderr.read() if process.stderr else ''}")
        watchdog.cancel()
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        stdout, stderr = process.communicate(timeout=120)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 128 + signal.SIGINT, stdout[-2000:] + stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip() and " INFO cx: " not in line]
    assert len(lines) == 1, stderr  # one line; no traceback, no launcher warnings
    stopped = re.fullmatch(
        r"cx-train: interrupted at step (\d+)/100000; step (\d+) is saved in (.+) \(--resume .*", lines[0]
    )
    assert stopped, lines[0]
    assert Path(stopped.group(3)) == save
    assert json.loads((save / "trainer.json").read_text())["step"] == int(stopped.group(2)) <= int(stopped.group(1))
    assert all(result.outcome is VerifyOutcome.OK for result in verify_checkpoints(save))  # committed whole
    assert not [str(p) for p in tmp_path.rglob("*") if ".cx-staging-" in p.name]  # at any depth
