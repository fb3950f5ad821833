"""What a cx-train user sees: the progress line's fields, `--metrics FILE.jsonl` (one object per log step, appended
without duplicates on resume), `--tensorboard`, the plot (and `cx-train plot`), MFU's inputs. matplotlib and
tensorboard are optional: their tests skip when absent, and their absence gives an install hint."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch

from cx_mesh.testing import distributed, run_distributed
from cx_train import parse_options
from cx_train._cli import main
from cx_train._train import run
from cx_train.metrics._log_record import LogRecord
from cx_train.metrics._memory import MemorySample
from cx_train.metrics._metrics_file import read_metrics
from cx_train.metrics._mfu import active_parameters, peak_flops
from cx_train.metrics._plot import plot_metrics
from cx_train.metrics._progress import Progress, loss_summary
from train_data_helpers import TINY_GPT, write_text

TINY = ["--steps", "4", "--batch-size", "2", "--seq-len", "16", "--hidden-size", "32", "--log-every", "2"]
KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "elapsed_s", "memory_kind", "memory_bytes"}
LINE = re.compile(
    r"step (\d+)/\d+ loss [0-9.]+ lr [0-9.e+-]+ gnorm [0-9.e+-]+ tok/s [0-9,]+ \d+ms/step "
    r"elapsed \d+:\d\d:\d\d eta \d+:\d\d:\d\d mem rss r0:\d+MiB r1:\d+MiB"
)


def _run(*flags: str) -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        run(parse_options([*TINY, *flags]))
    return printed.getvalue()


@distributed(world_size=2)
def test_train_metrics_file_lines_and_resume(rank: int, world_size: int, tmp_path: Path) -> None:
    """Two ranks, 4 steps logged every 2: two lines with every key, memory of both ranks, the progress line's fields;
    a run stopped after an unsaved step 6 (its line written, then a torn line) and resumed from the step-4 checkpoint
    keeps steps 2 and 4 and writes 6 once."""
    metrics, checkpoint = tmp_path / "run" / "metrics.jsonl", tmp_path / "ckpt"
    printed = _run("--metrics", str(metrics), "--save", str(checkpoint), "--lr", "1e-2")
    if rank == 0:
        assert [int(m.group(1)) for m in LINE.finditer(printed)] == [2, 4], printed
        records = read_metrics(metrics)
        assert [r["step"] for r in records] == [2, 4]
        for record in records:
            assert set(record) >= KEYS, record
            assert "eval_loss" not in record
            assert "aux_loss" not in record
            assert record["memory_kind"] == "rss"
            assert len(record["memory_bytes"]) == 2
            assert all(m > 0 for m in record["memory_bytes"])
            assert record["lr"] == pytest.approx(1e-2)
            assert math.isfinite(record["grad_norm"])
            assert record["grad_norm"] > 0
        with metrics.open("a") as file:  # the stopped run: an unsaved step 6, then a kill mid-line
            file.write(json.dumps({"step": 6, "loss": -1.0}) + "\n" + '{"step": 8, "lo')
    torch.distributed.barrier()
    _run("--metrics", str(metrics), "--steps", "6", "--resume", str(checkpoint), "--plugin", "low_level_zero")
    if rank == 0:
        lines = metrics.read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [2, 4, 6], lines
        assert json.loads(lines[-1])["loss"] > 0, "step 6 must be the resumed run's line, not the stopped run's"


@distributed(world_size=2)
def test_train_metrics_grad_norm_is_global(rank: int, world_size: int, tmp_path: Path) -> None:
    """The logged norm is over every rank's gradients: ZeRO (each rank holds half of them) logs DDP's norm. The
    plugins reduce the same numbers in another order: fp32 sums of a few thousand terms agree to ~1e-6 relative."""
    norms = {}
    for plugin in ("torch_ddp", "low_level_zero"):
        path = tmp_path / f"{plugin}.jsonl"
        _run("--plugin", plugin, "--metrics", str(path))
        if rank == 0:
            norms[plugin] = [r["grad_norm"] for r in read_metrics(path)]
    if rank == 0:
        for ddp, zero in zip(norms["torch_ddp"], norms["low_level_zero"], strict=True):
            assert abs(ddp - zero) <= 1e-4 * ddp, norms


@distributed(world_size=2)
def test_train_metrics_grad_norm_before_clipping(rank: int, world_size: int, tmp_path: Path) -> None:
    """With --clip the logged norm is the clipping's own measurement, before it scales: step 1 (the same weights and
    batch with or without clipping) logs the same norm, far above the bound; the run without --clip measures it."""
    norms = []
    for clip in ([], ["--clip", "1e-3"]):
        path = tmp_path / f"clip{len(clip)}.jsonl"
        _run("--log-every", "1", "--steps", "1", "--metrics", str(path), *clip)
        if rank == 0:
            norms.append(read_metrics(path)[0]["grad_norm"])
    if rank == 0:
        assert norms[1] > 1e-3 * 100, norms  # clipping had work to do
        assert abs(norms[0] - norms[1]) <= 1e-6 * norms[0], norms  # the same computation on the same gradients


def test_train_metrics_progress_line_fields() -> None:
    """The line names what its memory is (RSS on the CPU, allocated / reserved on CUDA) and shows MFU when known."""
    cpu = MemorySample("rss", [3 * 2**20, 5 * 2**20], None)
    record = LogRecord(
        step=10, total_steps=40, loss=2.5, lr=3e-4, grad_norm=0.75, tokens_per_s=1234.0, step_ms=12.0,
        elapsed_s=65.0, eta_s=195.0, memory=cpu,
    )  # fmt: skip
    line = record.line()
    for part in ("step 10/40", "loss 2.500", "lr 3.00e-04", "gnorm 0.75", "tok/s 1,234", "12ms/step"):
        assert part in line, line
    assert "elapsed 0:01:05 eta 0:03:15" in line, line
    assert line.endswith("mem rss r0:3MiB r1:5MiB"), line
    assert "mfu" not in line
    assert "eval" not in line
    cuda = MemorySample("cuda", [2**30], [2 * 2**30])
    moe = LogRecord(**{**record.__dict__, "memory": cuda, "mfu": 0.41, "aux_loss": 0.02, "eval_loss": 2.75})
    assert "mfu 41.0%" in moe.line()
    assert "eval 2.750" in moe.line()
    assert moe.line().endswith("mem alloc/reserved r0:1024/2048MiB"), moe.line()
    assert moe.json()["memory_reserved_bytes"] == [2 * 2**30]
    assert moe.json()["eval_loss"] == 2.75


def test_train_metrics_closing_line_says_what_it_averages() -> None:
    losses = [4.0] * 10 + [9.0] * 5 + [1.0] * 10
    assert loss_summary(losses) == "cx-train: loss 4.000 -> 1.000 (mean of this run's first and last 10 steps)"
    assert loss_summary(losses[:19]) is None  # too short for two disjoint means


def test_train_metrics_peak_flops_table(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peak_flops(torch.device("cpu"), "bf16") is None
    for name, peak in [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
                       ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA GeForce RTX 4090", None)]:  # fmt: skip
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_flops(torch.device("cuda", 0), "bf16") == peak, name
    assert peak_flops(torch.device("cuda", 0), "fp32") is None  # the bf16 peak would understate fp32 badly


def test_train_metrics_active_parameters_of_experts() -> None:
    """A routed expert counts top_k / experts of its parameters, a shared expert and the rest fully."""
    model = torch.nn.ModuleDict(
        {
            "embed": torch.nn.Embedding(10, 4),  # 40
            "experts": torch.nn.ModuleList([torch.nn.Linear(4, 4, bias=False) for _ in range(4)]),  # 4 x 16
            "shared_experts": torch.nn.Linear(4, 4, bias=False),  # 16
        }
    )
    assert active_parameters(model, num_experts=4, top_k=2) == 40 + 16 + 64 * 2 // 4
    assert active_parameters(model, num_experts=0, top_k=0) == 40 + 64 + 16


def _write_metrics(path: Path) -> None:
    rows = [
        {"step": s, "loss": 3.0 / s, "tokens_per_s": 100.0 + s, "memory_kind": "rss", "memory_bytes": [2**20, 2**21]}
        for s in (1, 2, 3)
    ]
    rows[-1]["eval_loss"] = 1.5
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_train_metrics_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    _write_metrics(tmp_path / "m.jsonl")
    written = plot_metrics(tmp_path / "m.jsonl")
    assert written == tmp_path / "m.png"
    assert written.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(tmp_path / "m.jsonl"), "-o", str(tmp_path / "out" / "x.png")]) == 0
    assert (tmp_path / "out" / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_train_metrics_plot_without_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cx-train plot` is a subcommand ahead of the training flags; without matplotlib it says how to install it."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    _write_metrics(tmp_path / "m.jsonl")
    with pytest.raises(SystemExit) as stopped:
        main(["plot", str(tmp_path / "m.jsonl")])
    assert stopped.value.code == 1
    assert "pip install 'cx-train[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "m.png").exists()


def test_train_metrics_tensorboard_missing_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(SystemExit) as stopped:
        parse_options([*TINY, "--tensorboard", str(tmp_path / "tb")])
    assert stopped.value.code == 2
    assert "pip install 'cx-train[tensorboard]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_options([*TINY, "--metrics", str(tmp_path)])  # a directory
    assert "is a directory" in capsys.readouterr().err


@distributed(world_size=2)
def test_train_metrics_tensorboard_events(rank: int, world_size: int, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    _run("--tensorboard", str(tmp_path / "tb"))
    if rank == 0:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*")), "no event file"


def test_train_metrics_eval_loss_reaches_the_next_log_step() -> None:
    """An evaluation between log steps is reported once, by the next log step, with the step it ran at."""
    progress = Progress(10, torch.device("cpu"))
    memory = MemorySample("rss", [1], None)
    assert "eval_loss" not in progress.record_for(2, memory, 1e-3).json()
    progress.note_eval(3, 2.25)
    logged = progress.record_for(4, memory, 1e-3).json()
    assert (logged["eval_loss"], logged["eval_step"]) == (2.25, 3)
    assert "eval_loss" not in progress.record_for(6, memory, 1e-3).json()


def _train(rank: int, world_size: int, flags: list[str]) -> None:
    run(parse_options(flags, world_size=world_size))


def test_train_metrics_eval_loss_of_user_data(tmp_path: Path) -> None:
    """`--eval-every 2` on `--data`: every logged step carries the evaluation that ran at it (it runs first)."""
    data, metrics = write_text(tmp_path / "a.txt", 3000), tmp_path / "m.jsonl"
    flags = [*TINY_GPT, "--data", str(data), "--eval-fraction", "0.1", "--eval-every", "2", "--log-every", "2"]
    flags += ["--steps", "4", "--batch-size", "2", "--plugin", "torch_ddp", "--metrics", str(metrics)]
    parse_options(flags, world_size=2)  # tokenises once, as the launcher does
    run_distributed(_train, 2, flags=flags)
    records = read_metrics(metrics)
    assert [(r["step"], r.get("eval_step")) for r in records] == [(2, 2), (4, 4)], records
    assert all(math.isfinite(r["eval_loss"]) and r["eval_loss"] > 0 for r in records)
