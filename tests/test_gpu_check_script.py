"""tools/gpu_check.sh, the GPU check for a machine with its own torch, kept working where CI runs: in CPU mode every
step runs (what needs CUDA skips itself or runs on the CPU), the report lists each with its status, and a step that
cannot run makes the script fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STEPS = ("environment", "gemini_offload", "fp8_linear", "train_mfu", "gpu_tests")

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and coreutils' timeout"
)


def _run(out: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(
        ["bash", str(SCRIPT), "--out", str(out), *arguments], env=env, capture_output=True, text=True, timeout=400
    )


def _statuses(report: str) -> dict[str, str]:
    return dict(re.findall(r"^\| (\w+) \| (pass|skip|fail) \| \d+ \| .+ \|$", report, re.MULTILINE))


@pytest.mark.slow
def test_gpu_check_script_cpu_mode_runs_every_step_and_passes(tmp_path: Path) -> None:
    result = _run(tmp_path, "--cpu", "--budget", "300")  # 50-80 s on a busy 2-core machine
    assert result.returncode == 0, result.stdout + result.stderr
    report = (tmp_path / "gpu_check_report.md").read_text()
    statuses = _statuses(report)
    assert list(statuses) == list(STEPS), report
    assert "fail" not in statuses.values(), report
    assert statuses["gpu_tests"] == "skip"  # every gpu test needs CUDA
    assert "- result: PASS" in report
    assert "- mode: cpu" in report
    for step in STEPS:
        assert (tmp_path / "gpu_check_logs" / f"{step}.log").is_file()
    assert "CPU kernel only" in report or "no CPU fp8 kernel" in report  # fp8 never claims a CUDA result here


def test_gpu_check_script_fails_when_a_step_cannot_run(tmp_path: Path) -> None:
    result = _run(tmp_path, "--cpu", "--budget", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    report = (tmp_path / "gpu_check_report.md").read_text()
    assert _statuses(report) == dict.fromkeys(STEPS, "fail"), report
    assert "- result: FAIL" in report
    assert report.count("| not run: the --budget of 0 s was spent |") == len(STEPS), report


def test_gpu_check_script_refuses_unknown_arguments(tmp_path: Path) -> None:
    assert _run(tmp_path, "--frobnicate").returncode == 2
    assert not (tmp_path / "gpu_check_report.md").exists()
