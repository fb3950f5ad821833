"""SIGKILL a saving process at every durable step: the previous checkpoint at the path stays fully loadable.

The save runs in a forked child whose `os.fsync`, `os.rename`, `os.replace`, atomic exchange and `shutil.rmtree`
are wrapped to count calls and SIGKILL the process at the N-th one. A dry run counts the calls first, so every step
of the real save is a kill point. After each kill the path must load as exactly the old or exactly the new
checkpoint, and as the old one whenever the kill came before the commit.
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import cx_checkpoint._atomic as atomic_module
from cx_checkpoint import CheckpointNotFoundError, GeneralCheckpointIO

_PATCHED = ("fsync", "rename", "replace", "exchange", "rmtree")


def _model(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 8))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(value)
    return model


def _save(target: Path, value: float, layout: str) -> None:
    io = GeneralCheckpointIO()
    if layout == "single":
        io.save_model(_model(value), target, use_safetensors=True)
    else:
        io.save_model(
            _model(value), target, shard=True, use_safetensors=True, size_per_shard=0.004, use_async=layout == "async"
        )
        io.synchronize()


def _loaded_value(target: Path) -> float | None:
    """The fill value of the checkpoint at `target` (None if absent); fails if it is mixed or does not load."""
    model = _model(-1.0)
    try:
        GeneralCheckpointIO().load_model(model, target)
    except CheckpointNotFoundError:
        return None
    values = {float(v) for p in model.parameters() for v in p.detach().unique()}
    assert len(values) == 1, f"a mixed checkpoint loaded: {values}"
    return values.pop()


class _Counter:
    """Wraps the durable-step functions; kills the process at call `kill_at` of `kind` (or only counts)."""

    def __init__(self, kind: str | None = None, kill_at: int = 0) -> None:
        self.kind, self.kill_at = kind, kill_at
        self.calls: list[str] = []
        self.saved: dict[str, Any] = {}

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            if name == self.kind and self.calls.count(name) == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return wrapper

    def __enter__(self) -> _Counter:
        self.saved = {
            "fsync": os.fsync,
            "rename": os.rename,
            "replace": os.replace,
            "exchange": atomic_module._exchange,
            "rmtree": shutil.rmtree,
        }
        os.fsync = self._wrap("fsync", os.fsync)
        os.rename = self._wrap("rename", os.rename)
        os.replace = self._wrap("replace", os.replace)
        atomic_module._exchange = self._wrap("exchange", atomic_module._exchange)
        shutil.rmtree = self._wrap("rmtree", shutil.rmtree)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync, os.rename, os.replace = self.saved["fsync"], self.saved["rename"], self.saved["replace"]
        atomic_module._exchange = self.saved["exchange"]
        shutil.rmtree = self.saved["rmtree"]


def _killed_save(target: Path, value: float, layout: str, kind: str, kill_at: int) -> int:
    """Fork a child that saves and is SIGKILLed at the chosen step; return its wait status."""
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            with _Counter(kind, kill_at):
                _save(target, value, layout)
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


@pytest.mark.parametrize("layout", ["sharded", "single", "async"])
def test_checkpoint_kill_during_save_keeps_previous(tmp_path: Path, layout: str) -> None:
    target = tmp_path / ("ckpt" if layout != "single" else "model.safetensors")
    _save(target, 1.0, layout)
    with _Counter() as dry:  # count every durable step of a replacing save
        _save(target, 1.0, layout)
    steps = [(kind, dry.calls[: i + 1].count(kind)) for i, kind in enumerate(dry.calls) if kind in _PATCHED]
    commit = next(i for i, kind in enumerate(dry.calls) if kind in ("exchange", "replace"))
    assert len(steps) >= 3
    for position, (kind, number) in enumerate(steps):
        status = _killed_save(target, 2.0, layout, kind, number)
        assert os.WIFSIGNALED(status), (kind, number, status)
        assert os.WTERMSIG(status) == signal.SIGKILL, (kind, number, status)
        value = _loaded_value(target)
        if position <= commit:  # the kill comes before the call runs
            assert value == 1.0, f"killed at {kind} #{number} (before the commit) but the path holds {value}"
        else:
            assert value in (1.0, 2.0), (kind, number, value)
        if value == 2.0:
            _save(target, 1.0, layout)  # back to the old checkpoint for the next kill point
    _save(target, 2.0, layout)  # a save after all those kills succeeds and cleans up the staging leftovers
    assert _loaded_value(target) == 2.0
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_checkpoint_kill_during_first_save_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    with _Counter() as dry:
        _save(tmp_path / "probe", 1.0, "sharded")
    fsyncs = dry.calls.count("fsync")
    for number in range(1, fsyncs):
        status = _killed_save(target, 2.0, "sharded", "fsync", number)
        assert os.WIFSIGNALED(status)
        assert _loaded_value(target) in (None, 2.0)
        if _loaded_value(target) is None:
            assert not target.exists()
