"""The `cx-plan` command: a ranked plan (table or JSON) from flags, and a one-line error with exit status 2 for each
impossible input (unknown device or link, unreadable memory size, a config missing fields, a world no layout splits).
The memory model is stubbed in the command's tests (its own tests measure it); the planner's traced model is checked
to share traces between candidates that differ only in what a trace does not see."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from cx_plan import _planner as planner
from cx_plan._candidate import Candidate
from cx_plan._cli import build_parser, main
from cx_plan._devices import Device, detect_device, lookup_device
from cx_plan._planner import MemoryModel
from cx_plan._report import MemoryVerdict, PlanReport, PlanRow, constructor_call, train_command
from cx_plan.measure import _measure as measure_module
from cx_plan.measure._measure import Measured
from cx_plan.memory._memory_model import memory_model
from cx_plan.trace import _trace_cache as trace_cache_module
from cx_plan.trace._activations import ActivationTrace, trace_stage
from cx_plan.trace._model_spec import ModelShape, shape_from_config
from cx_plugins.models import GPTConfig

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


def test_cx_plan_help_shows_every_default() -> None:
    """Every flag that is neither required nor an on/off switch says its default in --help."""
    parser = build_parser()
    formatter = parser.formatter_class(prog="cx-plan")
    for action in parser._actions:  # argparse has no public list of its actions
        if action.required or action.nargs == 0:
            continue
        assert "(default" in (formatter._get_help_string(action) or ""), action.option_strings


def test_cx_plan_prints_a_ranked_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_GPT, "--world", "2", "--device", "cpu", "--json"], memory_factory=_stub) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world"] == 2
    assert plan["device"]["name"] == "cpu"
    steps = [row["step_s"] for row in plan["rows"] if row["fits"]]
    assert steps == sorted(steps)
    assert plan["best"]["label"] == plan["rows"][0]["label"]
    # the model cx-plan judged (hidden 32, 2 layers), not cx-train's default size
    assert plan["best"]["cx_train"].startswith("cx-train --model gpt --hidden-size 32 --num-layers 2 ")
    # 300 KB: 450 KB of model states do not fit unsharded, 225 KB do; the rejected ones carry the reason
    flags = [*_GPT, "--world", "2", "--device", "cpu", "--device-memory", "300KB", "--plugins", "torch_ddp,gemini"]
    assert main([*flags, "--json"], memory_factory=_stub) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["candidate"]["plugin"] for r in rows if r["fits"]} == {"gemini"}
    assert all("model states" in r["reason"] for r in rows if not r["fits"])
    assert main([*flags, "--top", "2"], memory_factory=_stub) == 0
    table = capsys.readouterr().out
    assert "cx-plan: gpt on 2 x cpu (0.30 MB; 10% reserve, 0.27 MB usable)" in table
    assert "best: GeminiPlugin(" in table


def test_cx_plan_default_candidates_hold_torchtitans_layout(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --checkpointing, FSDP per block under the selective op policy (torchtitan's Llama layout) is judged."""
    assert main([*_GPT, "--world", "2", "--device", "cpu", "--all", "--plugins", "torch_fsdp", "--json"], _stub) == 0
    rows = [Candidate(**row["candidate"]) for row in json.loads(capsys.readouterr().out)["rows"]]
    assert any(c.fsdp_wrap == "block" and c.checkpoint_mode == "selective-op" for c in rows)


def test_cx_plan_optimizer_states_dtype_reaches_the_zero_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """--optimizer-states-dtype bf16 goes to every layout that runs ZeRO 1/2 or Gemini (its label, constructor call
    and cx-train command say so); DDP, FSDP and hybrid ZeRO 0 keep fp32 states."""
    flags = [*_GPT, "--world", "2", "--device", "cpu", "--all", "--optimizer-states-dtype", "bf16"]
    assert main([*flags, "--plugins", "torch_ddp,torch_fsdp,low_level_zero,gemini,hybrid", "--json"], _stub) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for row in rows:
        candidate = Candidate(**row["candidate"])
        zero = candidate.plugin in ("low_level_zero", "gemini", "hybrid") and candidate.stage >= 1
        assert candidate.optimizer_states_dtype == ("bf16" if zero else "fp32"), row["label"]
        assert (" bf16-states" in row["label"]) == zero
        command = train_command(candidate, "gpt", 32)
        assert command.endswith("--optimizer-states-dtype bf16") == zero, command
        assert ("optimizer_states_dtype='bf16'" in constructor_call(candidate)) == zero
    assert {Candidate(**r["candidate"]).plugin for r in rows if " bf16-states" in r["label"]} == {
        "low_level_zero",
        "gemini",
        "hybrid",
    }


def test_cx_plan_measure_refuses_another_device(capsys: pytest.CaptureFixture[str]) -> None:
    """Measuring here a plan made for another device would print, say, H100 predictions beside CPU figures."""
    here = detect_device().name
    other = "a100" if here != "a100" else "h100"
    assert main([*_GPT, "--world", "1", "--device", other, "--measure"], memory_factory=_stub) == 2
    error = capsys.readouterr().err
    assert f"this machine's device ({here})" in error
    assert f"--device {other}" in error


def test_cx_plan_json_with_measure_carries_the_measurements(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json no longer returns before --measure runs: the JSON plan gains a 'measured' list (the measurement is
    stubbed here; test_plan_measure runs a real one)."""
    asked: list[int] = []

    def fake_measure(
        report: PlanReport, model: str, *, hidden: int, layers: int, top: int, steps: int
    ) -> tuple[list[PlanRow], list[Measured]]:
        asked.append(top)
        rows = [row for row in report.rows if row.memory.fits][:top]
        return rows, [Measured(row.candidate, [1000], [5000], 0.25) for row in rows]

    monkeypatch.setattr(measure_module, "measure_report", fake_measure)
    flags = [*_GPT, "--world", "1", "--device", detect_device().name, "--measure", "--json", "--top", "1"]
    assert main(flags, memory_factory=_stub) == 0
    plan = json.loads(capsys.readouterr().out)
    assert asked == [1]
    assert plan["best"]["label"] == plan["measured"][0]["label"]
    assert plan["measured"][0]["measured_peak_bytes"] == 1000
    assert plan["measured"][0]["measured_step_s"] == 0.25


def test_cx_plan_measure_exits_non_zero_when_every_measurement_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every measured configuration failed (the issue's bare config.json folder measured nothing and exited 0):
    the table with each error is printed, then the command exits 1."""

    def failing(
        report: PlanReport, model: str, *, hidden: int, layers: int, top: int, steps: int
    ) -> tuple[list[PlanRow], list[Measured]]:
        rows = [row for row in report.rows if row.memory.fits][:top]
        return rows, [Measured(row.candidate, [], [], 0.0, error="OSError: no weights") for row in rows]

    monkeypatch.setattr(measure_module, "measure_report", failing)
    flags = [*_GPT, "--world", "1", "--device", detect_device().name, "--measure", "--top", "1", "--quiet"]
    assert main(flags, memory_factory=_stub) == 1
    captured = capsys.readouterr()
    assert "OSError: no weights" in captured.out
    assert "all 1 measurement(s) failed" in captured.err


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


def test_traced_memory_model_shares_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Candidates differing only in ZeRO stage share one trace, and the verdicts are `_fits.memory_model`'s."""
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=17, hidden_size=32, num_layers=2))
    traced: list[Candidate] = []
    real = trace_stage

    def counting(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int, *rest: None) -> ActivationTrace:
        traced.append(candidate)
        return real(shape, candidate, seq_len, stage)

    monkeypatch.setattr(trace_cache_module, "trace_stage", counting)
    device = lookup_device("cpu")
    model = planner.traced_memory_model(shape, 16, device)
    candidates = [Candidate("hybrid", dp=2, zero_stage=stage, micro_batch_size=2) for stage in (0, 1, 2)]
    verdicts = [model(c) for c in candidates]
    assert [c.micro_batch_size for c in traced] == [1, 2]  # the floor's micro-batch 1, then its own: once for all three
    assert verdicts[2] == memory_model(shape, 16, device.memory_bytes)(candidates[2])
    assert verdicts[0].prediction.optimizer_states == 2 * verdicts[1].prediction.optimizer_states  # ZeRO-1, dp 2


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ValueError("tp=3 does not divide the heads"), "cx refuses: tp=3 does not divide the heads"),
        (NotImplementedError("no splitter"), "cx refuses: no splitter"),
        (AttributeError("no attribute 'cx_sp_group'"), "trace failed: AttributeError: no attribute 'cx_sp_group'"),
        (TypeError("bad operand"), "trace failed: TypeError: bad operand"),
    ],
    ids=["value", "not-implemented", "attribute", "type"],
)
def test_a_failing_trace_is_a_row_not_the_end_of_the_plan(
    monkeypatch: pytest.MonkeyPatch, error: Exception, reason: str
) -> None:
    """cx's own refusals read "cx refuses: ..."; any other exception in a trace is a non-fitting "trace failed" row
    and the search goes on (before, an AttributeError ended the whole plan and a TypeError read as a refusal)."""
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=17, hidden_size=32, num_layers=2))

    def failing(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int, *rest: None) -> ActivationTrace:
        raise error

    monkeypatch.setattr(trace_cache_module, "trace_stage", failing)
    device = lookup_device("cpu")
    report = planner.plan(shape, 2, 16, device, planner.traced_memory_model(shape, 16, device))
    assert report.rows
    assert all(not row.memory.fits and row.memory.reason == reason for row in report.rows)


def test_plan_judges_memory_fastest_first_until_enough_fit() -> None:
    """With `enough`, memory is judged in order of predicted step time and the search stops at `enough` fitting
    candidates: those are exactly the first `enough` fitting rows of the full search."""
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2))
    device = lookup_device("cpu", memory_bytes=300_000)  # only sharded model states fit (see the stub)
    judged: list[Candidate] = []
    stub = _stub(shape, 32, device)

    def counting(candidate: Candidate) -> MemoryVerdict:
        judged.append(candidate)
        return stub(candidate)

    full = planner.plan(shape, 2, 32, device, stub)
    short = planner.plan(shape, 2, 32, device, counting, enough=3)
    assert short.considered == full.considered == len(full.rows) > len(short.rows) == len(judged)
    assert [r.candidate for r in short.rows if r.memory.fits] == [r.candidate for r in full.rows[:3]]
    assert f"{len(judged)} of {full.considered} candidates judged (fastest predicted first)" in short.table()
