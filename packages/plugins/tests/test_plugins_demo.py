"""The cx-train demo: its data, its flags, and a real multi-process run whose loss falls."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from cx_plugins.demo import CharTokenizer, GrammarText, TokenWindows, parse_options


def test_plugins_demo_data_is_deterministic_and_round_trips() -> None:
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


def test_plugins_demo_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
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


def test_plugins_demo_trains_on_two_processes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [sys.executable, "-m", "cx_plugins.demo", "--steps", "60", "--log-every", "20"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ranks=2" in result.stdout
    assert "step 60/60" in result.stdout
    match = re.search(r"cx-train: loss ([0-9.]+) -> ([0-9.]+)", result.stdout)
    assert match, result.stdout
    first, last = float(match.group(1)), float(match.group(2))
    assert last < first - 0.5, f"loss did not fall enough: {first} -> {last}"
