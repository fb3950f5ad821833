"""The harness's default time limit fits the run: scaled by ranks per CPU core (4 ranks on 2 cores get 240 s where a
flat 120 s killed a ColossalAI 4-rank test on a busy machine), and settable with CX_TEST_TIMEOUT."""

from __future__ import annotations

import os

import pytest

from cx_mesh.testing import DEFAULT_TIMEOUT_SECONDS, default_timeout


def test_mesh_default_timeout_scales_with_ranks_per_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CX_TEST_TIMEOUT", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_timeout(1) == default_timeout(2) == DEFAULT_TIMEOUT_SECONDS
    assert default_timeout(4) == 2 * DEFAULT_TIMEOUT_SECONDS
    assert default_timeout(8) == 4 * DEFAULT_TIMEOUT_SECONDS


def test_mesh_default_timeout_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CX_TEST_TIMEOUT", "900")
    assert default_timeout(4) == 900.0
    for bad in ("ten", "0", "-5"):
        monkeypatch.setenv("CX_TEST_TIMEOUT", bad)
        with pytest.raises(ValueError, match=f"CX_TEST_TIMEOUT='{bad}'"):
            default_timeout(2)
