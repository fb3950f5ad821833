"""`cx-train --timeout SECONDS`: how long a rank waits for a peer that is alive but stuck. It sets the process
group's timeout, which every group cx creates and every named collective (tp, ep, pipeline) then uses."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from cx_mesh import DEFAULT_TIMEOUT
from cx_train import _train, main, parse_options


def test_train_timeout_parsed_with_the_default_shown(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_options([]).timeout == DEFAULT_TIMEOUT.total_seconds() == 600
    assert parse_options(["--timeout", "30"]).timeout == 30.0
    assert parse_options(["--timeout", "0.5"]).timeout == 0.5
    for bad in ("0", "-5", "inf", "soon"):
        with pytest.raises(SystemExit) as caught:
            main(["--timeout", bad])
        assert caught.value.code == 2
        assert "--timeout" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--timeout TIMEOUT seconds a rank waits for a peer that is alive but stuck" in text
    assert "(default: 600.0)" in text[text.index("--timeout TIMEOUT seconds") :]


def test_train_timeout_is_the_launch_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: dict[str, Any] = {}
    monkeypatch.setattr(_train, "launch_from_torch", lambda **kwargs: launched.update(kwargs))
    monkeypatch.setattr(_train, "run", lambda options: [])
    _train.train(parse_options(["--timeout", "30"]))
    assert launched["timeout"] == timedelta(seconds=30)
    _train.train(parse_options([]))
    assert launched["timeout"] == DEFAULT_TIMEOUT
