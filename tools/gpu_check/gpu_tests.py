"""Step `gpu_tests`: the tests marked `gpu` (what `nox -s gpu` runs), with the installed torch and cx from
PYTHONPATH. Only the files that hold such tests are collected, so test modules needing a library this machine lacks
are not imported. A pass needs at least one test to have passed; all skipped (no CUDA, one GPU where two are needed)
is a skip."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpu_check_step import Skip, run_step

ROOT = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[str]:
    candidates = sorted(ROOT.glob("packages/*/tests/test_*.py")) + sorted(ROOT.glob("tests/test_*.py"))
    return [str(path.relative_to(ROOT)) for path in candidates if "pytest.mark.gpu" in path.read_text()]


class Tally:
    """The pytest plugin that keeps the run's outcome counts."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for outcome in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"):
            self.counts[outcome] = len(terminalreporter.stats.get(outcome, []))


def main() -> str:
    import pytest

    files = gpu_test_files()
    if not files:
        raise RuntimeError("no test file holds a test marked pytest.mark.gpu")
    tally = Tally()
    code = pytest.main(["-m", "gpu", "-q", "-p", "no:cacheprovider", *files, *sys.argv[1:]], plugins=[tally])
    summary = ", ".join(f"{n} {outcome}" for outcome, n in tally.counts.items() if n) or "nothing ran"
    summary += f" (in {len(files)} files)"
    if code != 0:
        raise RuntimeError(f"pytest exit status {int(code)}: {summary}")
    if not tally.counts.get("passed"):
        raise Skip(f"every test skipped itself: {summary}")
    return summary


if __name__ == "__main__":
    run_step(main)
