"""cx-train's checkpoints: a directory with the model and optimizer (sharded, safetensors) and `trainer.json`.

The three are committed as ONE unit: everything is written into a hidden staging sibling of the checkpoint
directory (`.<name>.cx-staging-step<N>`), `trainer.json` (the step reached, the plugin and world size that wrote it)
last, with its checksum in `cx-checksums.json` (`cx_checkpoint.record_checksums`, so `cx-checkpoint-verify` checks
it as it checks the model and optimizer), and only then is the staging directory swapped with the checkpoint
directory in one atomic step (`cx_checkpoint.commit_directory`). A process killed at any point leaves the previous
checkpoint whole (model, optimizer and step from the same step); the leftover staging directory is removed by the
next save. Any plugin at any world size can resume from any other's checkpoint: the files are the canonical cx
format.

`use_async=True` (`--save-every`, see `_run_saves.py`): the model and optimizer are gathered into CPU copies before the
call returns; the checkpoint IO's writer thread writes them and then runs the same commit, queued behind the writes
and run only if they all succeeded. Every save first waits for the previous one (collective: a failure of the
previous one is raised on every rank there), so its staging directory is never mistaken for a stale one.
"""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from cx_checkpoint import (
    CHECKSUMS_FILE,
    commit_directory,
    fsync_file,
    record_checksums,
    remove_stale_staging,
    run_and_agree,
    staging_path,
)
from cx_plugins import Booster, ModelWrapper, OptimizerWrapper
from cx_train.checkpoint._trainer_state import STATE_FILE, TrainerState, read_trainer_state
from cx_train.config._plugin_flags import LoraSettings
from cx_train.models._lora import ADAPTER_FOLDER, save_merged
from cx_train.models._tokenizer_files import save_tokenizer

__all__ = ["CONFIG_FILE", "SCHEDULER_FILE", "TrainerState", "load_checkpoint", "save_checkpoint"]

SCHEDULER_FILE = "lr_scheduler.json"
CONFIG_FILE = "config.toml"


def save_checkpoint(
    booster: Booster,
    model: nn.Module,
    optimizer: OptimizerWrapper,
    directory: Path,
    state: TrainerState,
    lr_scheduler: LRScheduler | None = None,
    config_text: str | None = None,
    use_async: bool = False,
    tokenizer: Any = None,
    lora: LoraSettings | None = None,
) -> None:
    """Save model, optimizer, LR scheduler (`lr_scheduler.json`), the run's resolved config (`config.toml`, which
    `--config` reads), the tokenizer's files (into `model/`, beside config.json) and trainer state, committed
    together (collective: every rank calls it); with `use_async`, written and committed in the background
    (`booster.synchronize()` waits for it). Under `lora` the adapters are saved (`adapter/`, peft's format) instead
    of the weights, and with `lora.merge` also the merged weights (`model/`)."""
    booster.synchronize()  # the previous save is on disk first (or its error raised on every rank)
    staging = staging_path(directory, f"step{state.step}")
    master = dist.get_rank() == 0

    def prepare() -> None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(directory)  # leftovers of a save that was killed
        staging.mkdir()

    run_and_agree(prepare if master else None, f"preparing {staging}")
    try:
        _write(
            booster, model, optimizer, staging, directory, state, lr_scheduler, config_text, use_async, tokenizer, lora
        )
    except Exception:
        booster.checkpoint_io.wait_for_writes()  # none may still be writing into the staging directory
        if master:  # a failed save (a full disk, a refused write) leaves nothing behind; the previous one stays
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _write(
    booster: Booster,
    model: nn.Module,
    optimizer: OptimizerWrapper,
    staging: Path,
    directory: Path,
    state: TrainerState,
    lr_scheduler: LRScheduler | None,
    config_text: str | None,
    use_async: bool,
    tokenizer: Any = None,
    lora: LoraSettings | None = None,
) -> None:
    """Everything into `staging`, then the one atomic commit over `directory` (collective; with `use_async` the
    master rank queues the commit behind the background writes instead)."""
    master = dist.get_rank() == 0
    if lr_scheduler is not None:  # first: a synchronous save waits for the writer
        booster.save_lr_scheduler(lr_scheduler, staging / SCHEDULER_FILE)
    if lora is None:
        booster.save_model(model, staging / "model", shard=True, use_safetensors=True, use_async=use_async)
    else:  # the adapters alone (the base weights are --model's), and with --merge-lora the merged weights
        booster.save_lora_as_pretrained(model, staging / ADAPTER_FOLDER, use_safetensors=True)
        if lora.merge:
            plain = model.unwrap() if isinstance(model, ModelWrapper) else model
            run_and_agree((lambda: save_merged(plain, staging / "model")) if master else None, "merging LoRA")
    booster.save_optimizer(optimizer, staging / "optimizer", shard=True, use_async=use_async)

    def commit() -> None:
        held = staging / "model" if (staging / "model").is_dir() else staging / ADAPTER_FOLDER
        # beside the weights' config.json: AutoTokenizer.from_pretrained(ckpt / "model")
        side_files = [] if tokenizer is None else save_tokenizer(tokenizer, held)
        if lora is not None:  # peft's and save_pretrained's files: no cx index records their checksums
            side_files = _plain_files(held)
            if held.name != ADAPTER_FOLDER:
                record_checksums(staging / ADAPTER_FOLDER, _plain_files(staging / ADAPTER_FOLDER))
        if side_files:  # cx-checkpoint-verify (and --resume) checks them with the rest
            record_checksums(held, side_files)
        written = [STATE_FILE]
        if lr_scheduler is not None:
            written.append(SCHEDULER_FILE)
        if config_text is not None:
            (staging / CONFIG_FILE).write_text(config_text)
            fsync_file(staging / CONFIG_FILE)
            written.append(CONFIG_FILE)
        (staging / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        fsync_file(staging / STATE_FILE)
        record_checksums(staging, written)  # cx-checkpoint-verify checks these too
        commit_directory(staging, directory)  # model, optimizer and trainer.json become visible at once

    if use_async:
        if master:  # runs once the writes of every rank are on disk (the master's end with the others')
            booster.checkpoint_io.queue_after_saves(commit)
        return
    booster.synchronize()
    run_and_agree(commit if master else None, f"committing the checkpoint {directory}")


def _plain_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != CHECKSUMS_FILE)


def load_checkpoint(
    booster: Booster,
    model: nn.Module,
    optimizer: OptimizerWrapper,
    directory: Path,
    lr_scheduler: LRScheduler | None = None,
) -> TrainerState:
    """Load what `save_checkpoint` wrote. A checkpoint from before the scheduler was saved has none: the scheduler
    is then moved to the step reached, which is where it would be (the schedule is a function of the step)."""
    state = read_trainer_state(directory)  # checked before any process started; again here for direct callers
    if not (directory / ADAPTER_FOLDER).is_dir():  # LoRA adapters were loaded before boosting (enable_lora)
        booster.load_model(model, directory / "model")
    booster.load_optimizer(optimizer, directory / "optimizer")
    if lr_scheduler is not None:
        if (directory / SCHEDULER_FILE).is_file():
            booster.load_lr_scheduler(lr_scheduler, directory / SCHEDULER_FILE)
        else:
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose here
                warnings.simplefilter("ignore", UserWarning)
                for _ in range(state.step):
                    lr_scheduler.step()
    return state
