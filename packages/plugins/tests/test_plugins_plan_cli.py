"""The `cx-plan` command: a ranked plan (table or JSON) from flags, and a one-line error with exit status 2 for each
impossible input (unknown device or link, unreadable memory size, a config missing fields, a world no layout splits).
The memory model is stubbed here (its own tests measure it); the command's job is the plumbing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from cx_plugins.plan._candidate import Candidate
from cx_plugins.plan._cli import main
from cx_plugins.plan._devices import Device
from cx_plugins.plan._model_spec import ModelShape
from cx_plugins.plan._planner import MemoryModel

_GPT = ["--model", "gpt", "--hidden-size", "32", "--num-layers", "2", "--seq-len", "32"]


@dataclass(frozen=True)
class _Verdict:
    fits: bool
    peak_bytes: int
    reason: str


def _stub(shape: ModelShape, seq_len: int, device: Device) -> MemoryModel:
    """Weights + AdamW (16 bytes a parameter) over the sharding ranks: fits below the device's memory."""

    def verdict(candidate: Candidate) -> _Verdict:
        split = candidate.tp * candidate.pp * (candidate.dp if candidate.stage == 3 else 1)
        peak = 16 * shape.parameters.total // split
        fits = peak <= device.memory_bytes
        return _Verdict(fits, peak, "" if fits else f"model states {peak} B > {device.memory_bytes} B")

    return verdict


def test_cx_plan_prints_a_ranked_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_GPT, "--world", "2", "--device", "cpu", "--json"], memory_factory=_stub) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world"] == 2
    assert plan["device"]["name"] == "cpu"
    steps = [row["step_s"] for row in plan["rows"] if row["fits"]]
    assert steps == sorted(steps)
    assert plan["best"]["label"] == plan["rows"][0]["label"]
    assert plan["best"]["cx_train"].startswith("cx-train --model gpt ")
    # 300 KB: 450 KB of model states do not fit unsharded, 225 KB do; the rejected ones carry the reason
    flags = [*_GPT, "--world", "2", "--device", "cpu", "--device-memory", "300KB", "--plugins", "torch_ddp,gemini"]
    assert main([*flags, "--json"], memory_factory=_stub) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["candidate"]["plugin"] for r in rows if r["fits"]} == {"gemini"}
    assert all("model states" in r["reason"] for r in rows if not r["fits"])
    assert main([*flags, "--top", "2"], memory_factory=_stub) == 0
    table = capsys.readouterr().out
    assert "cx-plan: gpt on 2 x cpu (0.30 MB)" in table
    assert "best: GeminiPlugin(" in table


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--world", "2", "--device", "tpu"], "unknown device 'tpu'"),
        (["--world", "2", "--device-memory", "eighty"], "cannot read the memory size 'eighty'"),
        (["--world", "2", "--intra-link", "carrier-pigeon"], "unknown interconnect 'carrier-pigeon'"),
        (["--world", "7", "--global-batch", "8"], "no configuration splits 7 ranks"),
        (["--world", "2", "--checkpointing", "half"], "--checkpointing takes comma-separated numbers"),
    ],
)
def test_cx_plan_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_GPT, *flags], memory_factory=_stub) == 2
    error = capsys.readouterr().err
    assert error.startswith("cx-plan: error: ")
    assert message in error


def test_cx_plan_config_missing_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["--model", str(config), "--world", "2"], memory_factory=_stub) == 2
    error = capsys.readouterr().err
    assert "lacks vocab_size" in error
    assert "num_hidden_layers" in error
