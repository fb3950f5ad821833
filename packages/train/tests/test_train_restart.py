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

from cx_mesh.testing import free_port
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


def _cx_train(tmp_path: Path, name: str, *extra: str, out: str | None = None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    flags = [*FLAGS, "--save", str(tmp_path / name), "--metrics", str(tmp_path / f"{name}.jsonl"), *extra]
    output = (tmp_path / f"{out or name}.out").open("w")
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
    assert restarted(options, 2) is options  # the first start: nothing changes
    monkeypatch.setenv(RESTART_VARIABLE, "1")
    assert restarted(options, 2).resume is None  # nothing saved yet: from the start
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainer.json").write_text('{"step": 8, "plugin": "gemini", "world_size": 2}')
    assert restarted(options, 2).resume == tmp_path / "ckpt"
    assert restarted(options, 2).restart == 1


def _node(tmp_path: Path, name: str, endpoint: str, *extra: str, host: bool) -> subprocess.Popen[bytes]:
    """One machine of an elastic job (`--nnodes 1:2`): a cx-train launcher with one rank, meeting at `endpoint`,
    whose rendezvous store the `host` machine holds (both are this machine: the first to bind would win)."""
    # read_timeout: how long the non-host waits for the host's MASTER_ADDR after the rendezvous (torch's 60 s
    # default was outlasted once on a loaded 2-core machine)
    settings = f"last_call_timeout=3,read_timeout=300,is_host={int(host)}"
    elastic = ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-conf", settings]
    return _cx_train(tmp_path, "elastic", "--nproc", "1", *elastic, "--max-restarts", "1", *extra, out=name)


def test_train_restart_at_a_smaller_world_keeps_the_global_batch(tmp_path: Path) -> None:
    """Two machines of one rank each (`--nnodes 1:2`); one is lost for good (its launcher killed with SIGKILL), and
    the other restarts alone: data-parallel size 1, each rank's batch doubled to keep the global batch of 4, the
    same windows in the same order. Its losses equal the uninterrupted two-rank run's to the rounding of averaging
    the gradient over one rank instead of two (fp32: measured 1.7e-7 relative at most over 48 steps; bound 1e-4)."""
    straight = _cx_train(tmp_path, "straight", "--steps", "48")
    assert straight.wait(timeout=WAIT_S) == 0, (tmp_path / "straight.out").read_text()[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    first = _node(tmp_path, "first", endpoint, "--steps", "48", host=True)
    second = _node(tmp_path, "second", endpoint, "--steps", "48", host=False)  # the machine that is lost
    nodes, ranks = [first, second], []
    try:
        deadline = time.monotonic() + WAIT_S
        while not any("step 12/" in (tmp_path / f"{n}.out").read_text() for n in ("first", "second")):
            assert first.poll() is None, (tmp_path / "first.out").read_text()[-3000:]
            assert second.poll() is None, (tmp_path / "second.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 12"
            time.sleep(0.2)
        ranks = sorted(pid for pid in _children(second.pid) if _alive(pid))
        os.kill(second.pid, signal.SIGKILL)  # a machine lost: its launcher, and with it its rank
        assert first.wait(timeout=WAIT_S) == 0, (tmp_path / "first.out").read_text()[-3000:]
    finally:
        for pid in [*(n.pid for n in nodes), *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    printed = (tmp_path / "first.out").read_text()
    said = re.search(r"at step (\d+);.*data-parallel size 1 \(the checkpoint's was 2\), 4 sequences per rank", printed)
    assert said is not None, printed[-3000:]
    resumed = int(said.group(1))
    assert resumed >= 8, said.group(0)
    want, got = _losses(tmp_path / "straight.jsonl"), _losses(tmp_path / "elastic.jsonl")
    assert sorted(got) == list(range(1, 49))
    for step in range(1, 49):
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), (step, got[step], want[step])


def test_train_elastic_flags_and_the_resized_restart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--nnodes MIN:MAX` and its rendezvous flags reach torchrun in place of `--standalone`, are checked up front,
    and a restart at another data-parallel size keeps the checkpoint's global batch (or says why it cannot)."""
    save = ["--save", str(tmp_path / "ckpt"), "--max-restarts", "1"]
    options = parse_options(
        ["--nnodes", "1:2", "--rdzv-endpoint", "node0:29400", "--rdzv-conf", "join_timeout=60", *save]
    )
    assert options.rendezvous is not None
    assert options.rendezvous.torchrun_arguments() == [
        "--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0:29400", "--rdzv-id", "cx-train",
        "--rdzv-conf", "join_timeout=60",
    ]  # fmt: skip
    assert parse_options(save).rendezvous is None
    for flags, said in [
        (["--nnodes", "2:1", "--rdzv-endpoint", "h:1"], "--nnodes 2:1: give a node count N or MIN:MAX"),
        (["--nnodes", "2"], "--nnodes needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:port"], "--nnodes needs --rdzv-endpoint HOST:PORT"),
        (["--rdzv-endpoint", "h:1"], "--rdzv-endpoint needs --nnodes"),
    ]:
        with pytest.raises(SystemExit):
            parse_options(flags)
        assert said in capsys.readouterr().err, flags

    options = parse_options([*save, "--batch-size", "3"])
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "trainer.json").write_text('{"step": 8, "plugin": "gemini", "world_size": 2}')
    monkeypatch.setenv(RESTART_VARIABLE, "1")
    same = restarted(options, 2)
    assert (same.batch_size, same.resized_from) == (3, None)
    alone = restarted(options, 1)
    assert (alone.batch_size, alone.resized_from) == (6, 2)  # the global batch of 6 over one rank
    with pytest.raises(ValueError, match="data-parallel size 4, which does not divide the checkpoint's global batch"):
        restarted(options, 4)
