"""Ranks end with their launcher: `cx-train` killed with SIGKILL (as an OOM killer does) used to leave both ranks
training as orphans, one of them writing a checkpoint 40 s later. Now each rank sees its parent gone and stops within
seconds, saying so."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WAIT_S = 240.0  # generous: two ranks start and build on a busy 2-core machine


def _children(pid: int) -> list[int]:
    """The process ids whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_train_ranks_stop_when_the_launcher_is_killed(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    flags = ["--nproc", "2", "--steps", "100000", "--log-every", "1", "--batch-size", "2", "--seq-len", "16",
             "--hidden-size", "32", "--save", str(tmp_path / "ckpt"), "--save-every", "50"]  # fmt: skip
    output = (tmp_path / "out.txt").open("w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cx_train", *flags], env=env, stdout=output, stderr=subprocess.STDOUT
    )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while "step 2/" not in (tmp_path / "out.txt").read_text():
            assert launcher.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run did not reach step 2"
            time.sleep(0.5)
        ranks = _children(launcher.pid)
        assert len(ranks) >= 2, ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.5)
        survivors = [pid for pid in ranks if _alive(pid)]
        assert not survivors, f"ranks {survivors} outlived their launcher"
        assert "its parent process" in (tmp_path / "out.txt").read_text()
    finally:
        for pid in [launcher.pid, *ranks, *_children(launcher.pid)]:  # nothing outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        output.close()


def test_train_forked_worker_stops_when_its_parent_is_gone() -> None:
    """The token cache's tokenising workers run `exit_with_parent` too (their pool's initializer): a forked worker
    shares the cache lock's file, and one that outlived a killed parent kept the lock, so a restart waited on it."""
    script = (
        "import os, sys, time\n"
        "from cx_train._launcher_watch import exit_with_parent\n"
        "parent = os.getpid()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    exit_with_parent('tokenising', parent)\n"  # as the pool passes it: the child may start after the exit
        "    time.sleep(120)\n"
        "    os._exit(0)\n"
        "print(pid, flush=True)\n"
        "os._exit(0)\n"  # the parent dies at once, as under SIGKILL: nothing is passed on
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    worker = int(result.stdout.strip())
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _alive(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the forked worker outlived its parent"
