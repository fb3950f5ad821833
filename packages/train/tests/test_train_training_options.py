"""cx-train's optimisation flags: gradient accumulation equals the larger batch, clipping, the LR schedule and its
state across a checkpoint, activation checkpointing and compile refusals, and every flag's default in --help."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import TEST_ADAM_EPS, distributed, sum_tolerance, tiny_model_adam_tolerance
from cx_plugins import Booster, LowLevelZeroPlugin, accumulated_step
from cx_plugins.models import GPT
from cx_train import parse_options
from cx_train.checkpoint._checkpointing import (
    CONFIG_FILE,
    SCHEDULER_FILE,
    TrainerState,
    load_checkpoint,
    save_checkpoint,
)
from cx_train.config._parser import build_parser
from cx_train.models._plugins import plan_candidate
from cx_train.step._optimization import make_optimizer, make_scheduler, prepare_model
from train_test_helpers import CONFIG, make_plugin

LR = 1e-2


def _gpt_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = model(batch, labels=batch)
    return loss


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as caught:
        parse_options(argv)
    assert caught.value.code == 2
    return capsys.readouterr().err


def test_train_every_training_flag_shows_its_default() -> None:
    text = " ".join(build_parser().format_help().split())
    for flag, default in [
        ("--lr-schedule", "constant"),
        ("--warmup-steps", "0"),
        ("--weight-decay", "0.0"),
        ("--grad-accum", "1"),
        ("--clip", "0.0"),
        ("--activation-checkpointing", "off"),
        ("--compile", "off"),
        ("--compile-backend", "inductor"),
        ("--config", "none"),
        ("--dry-run", "off"),
    ]:
        start = text.index(flag + " ", text.index("optimisation:"))  # the flag list, past the usage
        shown = text[text.index("(default:", start) :]  # the first default after the flag is its own
        assert shown.startswith(f"(default: {default}"), (flag, shown[:80])


def test_train_training_flags_refused_where_they_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--compile is not supported with --plugin gemini" in _refusal(["--compile"], capsys)
    assert "gemini plugin does not support gradient accumulation" in _refusal(["--grad-accum", "2"], capsys)
    err = _refusal(["--plugin", "torch_ddp", "--activation-checkpointing"], capsys)
    assert "reference GPT has no activation checkpointing" in err
    assert "--warmup-steps 20 must be below --steps 10" in _refusal(["--steps", "10", "--warmup-steps", "20"], capsys)
    err = _refusal(["--plugin", "hybrid", "--pp", "2", "--grad-accum", "2"], capsys)
    assert "--grad-accum with --pp" in err
    options = parse_options(["--plugin", "torch_ddp", "--compile", "--grad-accum", "3", "--clip", "1"])
    assert (options.compile, options.grad_accum, options.clip) == (True, 3, 1.0)


def test_train_lr_schedules_follow_their_curves() -> None:
    def rates(schedule: str) -> list[float]:
        options = parse_options(["--steps", "10", "--warmup-steps", "2", "--lr-schedule", schedule])
        optimizer = make_optimizer(torch.nn.Linear(2, 2), options)
        scheduler = make_scheduler(optimizer, options)
        seen = []
        for _ in range(10):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    lr = 1e-3
    assert rates("constant") == pytest.approx([lr / 2, lr] + [lr] * 8)
    linear = rates("linear")  # ColossalAI's LinearWarmupLR: its warm-up reaches the rate at step 2, then falls to 0
    assert linear[0] < linear[1] < linear[2] == pytest.approx(lr)
    assert all(a > b for a, b in itertools.pairwise(linear[2:]))
    assert linear[-1] < 0.2 * lr
    cosine = rates("cosine")
    assert cosine[:3] == pytest.approx([lr / 2, lr, lr])
    assert all(a > b for a, b in itertools.pairwise(cosine[2:]))
    assert cosine[-1] < 0.05 * lr


def test_train_weight_decay_reaches_adamw() -> None:
    options = parse_options(["--weight-decay", "0.1"])
    assert make_optimizer(torch.nn.Linear(2, 2), options).param_groups[0]["weight_decay"] == 0.1


def test_train_activation_checkpointing_switches() -> None:
    pytest.importorskip("transformers")
    options = parse_options(["--plugin", "torch_ddp", "--model", "llama", "--activation-checkpointing"])
    from cx_train.models._spec import build_model, describe_model

    model = prepare_model(build_model(describe_model(options.model_spec), seed=0), options, is_hf=True)
    name = (
        "is_activation_checkpointing" if hasattr(model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    )
    assert getattr(model, name)
    hybrid = parse_options(["--plugin", "hybrid", "--model", "llama", "--activation-checkpointing", "--tp", "2"])
    assert plan_candidate(hybrid, 2).checkpoint_ratio == 1.0  # make_plugin: every layer through ShardFormer


def _plain(seed: int = 0) -> GPT:
    return GPT(CONFIG, seed=seed)


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "low_level_zero"])
def test_train_grad_accum_equals_the_larger_batch(rank: int, world_size: int, plugin: str) -> None:
    """N micro-steps of batch b (no_sync on all but the last, loss / N) and one step of batch N*b: same losses, same
    parameters, within the rounding of summing the gradient in another order."""
    accumulate, micro, length, steps = 3, 2, CONFIG.max_positions, 3
    generator = torch.Generator().manual_seed(7)
    data = torch.randint(0, CONFIG.vocab_size, (steps, world_size, accumulate * micro, length), generator=generator)

    def run(split: int) -> tuple[list[float], dict[str, torch.Tensor]]:
        booster = Booster(plugin=LowLevelZeroPlugin(stage=2) if plugin == "low_level_zero" else make_plugin(plugin))
        plain = _plain()
        adam = torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS)
        model, optimizer, *_ = booster.boost(plain, adam)
        assert optimizer is not None
        losses = []
        for step in range(steps):
            mine = data[step, rank]
            micro_losses, _ = accumulated_step(booster, model, optimizer, list(mine.chunk(split)), _gpt_loss)
            mean = torch.stack(micro_losses).mean().reshape(1)
            dist.all_reduce(mean)
            losses.append(float(mean) / world_size)
        state = {n: p.detach().float().clone() for n, p in plain.named_parameters()}
        return losses, state

    accumulated, accumulated_state = run(accumulate)
    whole, whole_state = run(1)
    tokens = world_size * accumulate * micro * length
    # a loss is a mean of per-token terms each under ~ln(vocab) + a few; an update's gradient a sum over the tokens
    loss_tolerance = sum_tolerance(n_terms=64 * tokens, magnitude=2 * float(torch.tensor(CONFIG.vocab_size).log()))
    assert accumulated == pytest.approx(whole, abs=loss_tolerance)
    tolerance = tiny_model_adam_tolerance(LR, steps, tokens)
    for name, value in whole_state.items():
        difference = float((accumulated_state[name] - value).abs().max())
        assert difference <= tolerance, (name, difference, tolerance)
    assert max(abs(a - b) for a, b in zip(accumulated, whole, strict=True)) >= 0  # compared, not skipped


@distributed(world_size=2)
def test_train_clip_bounds_the_update(rank: int, world_size: int) -> None:
    """With SGD the update is lr * the clipped gradient, so its norm is at most lr * --clip; the returned norm is the
    one before clipping (larger than the clip here)."""
    booster = Booster(plugin=make_plugin("torch_ddp"))
    plain = _plain()
    before = [p.detach().clone() for p in plain.parameters()]
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=1.0))
    assert optimizer is not None
    batch = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_positions), generator=torch.Generator().manual_seed(3))
    clip = 1e-3
    _, norm = accumulated_step(booster, model, optimizer, [batch], _gpt_loss, clip=clip)
    assert norm is not None
    assert float(norm) > clip
    update = torch.cat([(p.detach() - b).flatten() for p, b in zip(plain.parameters(), before, strict=True)])
    assert float(update.norm()) <= clip * (1 + 1e-5)


@distributed(world_size=2)
def test_train_checkpoint_keeps_the_schedule_and_the_config(rank: int, world_size: int, tmp_path: Path) -> None:
    """The resumed scheduler is where the saved one was, so the rates continue the same curve; the resolved config
    is saved beside it and reads back as a --config file."""
    argv = ["--plugin", "torch_ddp", "--steps", "10", "--warmup-steps", "2", "--lr-schedule", "cosine"]
    options = parse_options(argv)
    directory = tmp_path / "ckpt"

    def boosted() -> tuple[Booster, torch.nn.Module, object, torch.optim.lr_scheduler.LRScheduler]:
        booster = Booster(plugin=make_plugin("torch_ddp"))
        plain = _plain()
        optimizer = make_optimizer(plain, options)
        scheduler = make_scheduler(optimizer, options)
        model, wrapped, *_ = booster.boost(plain, optimizer, lr_scheduler=scheduler)
        return booster, model, wrapped, scheduler

    booster, model, optimizer, scheduler = boosted()
    batch = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_positions), generator=torch.Generator().manual_seed(1))
    for _ in range(4):
        accumulated_step(booster, model, optimizer, [batch], _gpt_loss)  # type: ignore[arg-type]
        scheduler.step()
    from cx_train.config._config_file import resolved_toml

    text = resolved_toml(dict(options.resolved))
    state = TrainerState(4, "torch_ddp", world_size)
    save_checkpoint(booster, model, optimizer, directory, state, scheduler, text)  # type: ignore[arg-type]
    expected = []
    for _ in range(3):
        expected.append(scheduler.get_last_lr()[0])
        scheduler.step()

    booster, model, optimizer, resumed = boosted()
    assert load_checkpoint(booster, model, optimizer, directory, resumed).step == 4  # type: ignore[arg-type]
    got = []
    for _ in range(3):
        got.append(resumed.get_last_lr()[0])
        resumed.step()
    assert got == expected
    assert (directory / SCHEDULER_FILE).is_file()
    read_back = dict(parse_options(["--config", str(directory / CONFIG_FILE)]).resolved)
    assert read_back.pop("config") == directory / CONFIG_FILE
    assert read_back == {k: v for k, v in options.resolved if k != "config"}


def test_train_compile_trains(tmp_path: Path) -> None:
    """--compile on the simplest plugin: torch.compile of the reference GPT on CPU, a few steps. Dynamo traces the
    boosted model either way; the aot_eager backend skips inductor's code generation (177 s of C++ compiles on 2
    busy cores), which is torch's to test, not cx's."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    flags = ["--plugin", "torch_ddp", "--nproc", "1", "--compile", "--steps", "3", "--log-every", "1"]
    flags += ["--compile-backend", "aot_eager"]
    flags += ["--hidden-size", "32", "--num-layers", "1", "--seq-len", "16", "--batch-size", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "cx_train", *flags], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert re.search(r"step 3/3 loss [0-9.]+", result.stdout), result.stdout


@distributed(world_size=2)
def test_train_resume_continues_schedule_and_accumulation_exactly(
    rank: int, world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped at step 2 of 5 (cosine schedule with warm-up, 2 micro-batches a step) and resumed gives the
    uninterrupted run's losses for steps 3 to 5 bit for bit: the same weights, optimizer state, schedule position
    and next micro-batches (same plugin and world size, so the same arithmetic). The optimizer checkpoint restores
    the rate of step 3 by itself; a scheduler that restarted would show from step 5's loss on."""
    import shutil

    from cx_train import _train
    from cx_train.checkpoint import _run_saves

    flags = ["--plugin", "torch_ddp", "--hidden-size", "16", "--num-layers", "1", "--seq-len", "8"]
    flags += ["--batch-size", "2", "--grad-accum", "2", "--lr-schedule", "cosine", "--warmup-steps", "1"]
    flags += ["--steps", "5", "--log-every", "5", "--lr", "0.01"]
    saved, at_step_2 = tmp_path / "run", tmp_path / "step2"
    real_save = save_checkpoint  # what the run's saves call, replaced there below

    def save_and_keep_step_2(*args: Any, **kwargs: Any) -> None:
        real_save(*args, **kwargs)
        state = args[4]
        if getattr(state, "step", None) == 2:
            args[0].synchronize()  # a --save-every save is written in the background
            if rank == 0:
                shutil.copytree(saved, at_step_2)
        dist.barrier()

    monkeypatch.setattr(_run_saves, "save_checkpoint", save_and_keep_step_2)
    whole = _train.run(parse_options([*flags, "--save", str(saved), "--save-every", "2"]))
    monkeypatch.undo()
    resumed = _train.run(parse_options([*flags, "--resume", str(at_step_2), "--no-verify"]))
    assert len(whole) == 5
    assert resumed == whole[2:]
