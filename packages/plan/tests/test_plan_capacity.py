"""Honest capacities: device rows hold what the devices report, the reserve is said and settable, a peak inside
the reserve is a tight fit (ranked after comfortable ones), and `--device-memory 80GiB` means 80 x 2^30 bytes; an
existing path wins over a preset's name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cx_plan._candidate import Candidate
from cx_plan._cli import main
from cx_plan._devices import lookup_device, parse_memory, parse_reserve
from cx_plan._report import PlanReport, PlanRow, rank_rows
from cx_plan.memory._fits import fits
from cx_plan.memory._memory import MemoryPrediction
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace._model_spec import load_model_shape, shape_from_config
from cx_plugins.models import GPTConfig

_GIB, _MIB = 2**30, 2**20


def test_device_rows_hold_what_the_devices_report() -> None:
    assert lookup_device("h100").memory_bytes == 81_559 * _MIB  # 85.5 x 10^9 bytes, not the datasheet's 80 x 10^9
    assert lookup_device("a100").memory_bytes == 81_920 * _MIB
    assert parse_memory("80GiB") == 80 * _GIB
    assert parse_memory("80GB") == 80 * 10**9
    assert lookup_device("h100").usable_bytes == int(81_559 * _MIB * 0.9)


def test_reserve_parses_as_percent_fraction_or_size() -> None:
    memory = 80 * _GIB
    assert parse_reserve("5%", memory) == pytest.approx(0.05)
    assert parse_reserve("0.05", memory) == pytest.approx(0.05)
    assert parse_reserve("4GiB", memory) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="not below the device's memory"):
        parse_reserve("100GiB", memory)


def _prediction(peak: int) -> MemoryPrediction:
    return MemoryPrediction(Candidate("torch_fsdp", dp=8), 0, peak, 0, 0, 0, 0, 0, 0, 0)


def test_a_peak_inside_the_reserve_is_a_tight_fit() -> None:
    """torchtitan's 8B layout, 78.47 GB predicted, on an H100 (85.5 GB reported, 77.0 usable): tight, not "no"."""
    h100 = lookup_device("h100")
    tight = fits(_prediction(78_470_000_000), h100.memory_bytes)
    assert tight.fits
    assert tight.tight
    assert "inside the 10% reserve" in tight.reason
    comfortable = fits(_prediction(70 * 10**9), h100.memory_bytes)
    assert comfortable.fits
    assert not comfortable.tight
    assert comfortable.reason == ""
    over = fits(_prediction(86 * 10**9), h100.memory_bytes)
    assert not over.fits
    assert "of the device" in over.reason


def test_tight_rows_rank_after_comfortable_ones_and_say_so() -> None:
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2))
    device = lookup_device("h100")
    fast, slow = Candidate("hybrid", dp=2, micro_batch_size=4), Candidate("torch_ddp", dp=2, micro_batch_size=1)
    tight = fits(_prediction(80 * 10**9), device.memory_bytes)
    comfortable = fits(_prediction(10**9), device.memory_bytes)
    rows = [PlanRow(fast, tight, predict_step_time(fast, shape, 32, device)),
            PlanRow(slow, comfortable, predict_step_time(slow, shape, 32, device))]  # fmt: skip
    ranked = rank_rows(rows)
    assert [r.candidate for r in ranked] == [slow, fast]
    text = PlanReport("gpt", 2, 32, device, ranked).table()
    assert " tight " in text
    assert "81,559 MiB; 10% reserve" in text
    assert PlanReport("gpt", 2, 32, device, ranked).as_json()["rows"][1]["tight"]


def test_cli_reserve_flag(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "gpt", "--hidden-size", "32", "--num-layers", "2", "--seq-len", "32", "--world", "2",
            "--device", "h100", "--quiet", "--top", "1"]  # fmt: skip
    assert main([*argv, "--reserve", "5%", "--device-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "85.90 GB = 81,920 MiB; 5% reserve, 81.60 GB usable" in out
    assert main([*argv, "--reserve", "lots"]) == 2
    assert dataclasses.replace(lookup_device("h100"), reserve=0.0).usable_bytes == 81_559 * _MIB


def test_an_existing_path_wins_over_a_preset_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--model llama` with a folder `llama/` here plans the folder (it planned the 308k-parameter preset), says
    that the name is both, and prints a cx-train command that trains the folder (`--model ./llama`, no sizes)."""
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    argv = ["--model", "llama", "--world", "1", "--seq-len", "32", "--device", "cpu", "--json", "--quiet", "--top", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "both a built-in model and a path here" in captured.err
    plan = json.loads(captured.out)
    assert plan["model"] == "./llama"
    assert plan["best"]["cx_train"].startswith("cx-train --model ./llama --plugin ")
    assert load_model_shape("llama").parameters.total == load_model_shape("./llama").parameters.total


def test_identical_zero1_and_zero2_rows_are_shown_once_with_the_reason() -> None:
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2))
    device = lookup_device("h100")
    one, two = (Candidate("hybrid", dp=2, tp=2, zero_stage=stage) for stage in (1, 2))
    other = Candidate("low_level_zero", dp=4, zero_stage=1)
    same = fits(_prediction(10**9), device.memory_bytes)
    rows = [PlanRow(c, same, predict_step_time(c, shape, 32, device)) for c in (one, two)]
    rows.append(
        PlanRow(other, fits(_prediction(2 * 10**9), device.memory_bytes), predict_step_time(other, shape, 32, device))
    )
    text = PlanReport("gpt", 4, 32, device, rank_rows(rows)).table()
    assert "hybrid dp2 tp2 zero1" in text
    assert "hybrid dp2 tp2 zero2" not in text
    assert text.count("zero1 = zero2 here:") == 1
    assert "low_level_zero dp4 zero1" in text  # no twin: shown as it is


def test_identical_zero1_and_zero2_misses_are_shown_once_too() -> None:
    """A pair that does not fit is one row as well (an 8B plan showed rows 6 / 7 and 8 / 9 as such pairs)."""
    shape = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=33, hidden_size=32, num_layers=2))
    device = lookup_device("h100")
    miss = fits(_prediction(200 * 10**9), device.memory_bytes)
    rows = [
        PlanRow(c, miss, predict_step_time(c, shape, 32, device))
        for c in (Candidate("hybrid", dp=2, tp=2, zero_stage=stage) for stage in (1, 2))
    ]
    text = PlanReport("gpt", 4, 32, device, rank_rows(rows)).table()
    assert "hybrid dp2 tp2 zero1" in text
    assert "hybrid dp2 tp2 zero2" not in text
    assert text.count("zero1 = zero2 here:") == 1
    assert "nothing fits" in text


def test_fsdp_rows_do_not_advise_fsdp() -> None:
    prediction = MemoryPrediction(Candidate("torch_fsdp", dp=8, fsdp_wrap="model"), 0, 0, 90 * 10**9, 0, 0, 0, 0, 0, 0)
    reason = fits(prediction, lookup_device("h100").memory_bytes).reason
    assert "largest: gradients" in reason
    assert "FSDP to shard" not in reason
    assert "fsdp_wrap='block'" in reason
