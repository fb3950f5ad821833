"""The checkpoints of one cx-train run: `--save-every` ones are written in the background while training goes on, the
final one before the run ends.

A periodic save gathers the model and optimizer into CPU copies and returns (`save_checkpoint(use_async=True)`): the
checkpoint IO's writer thread writes them and then commits the folder as one unit, as a synchronous save does, so a
run killed at any point still leaves the previous checkpoint whole. The next save first waits for it (one in flight
at a time; its error is raised there on every rank); the final save is synchronous; an interrupt waits for the
pending save before it reports what is saved; and on the way out, an error included, each rank waits for its own
writes without communicating, so no write outlives the run (and the `--save` folder's lock) that made it. Rank 0
prints "saved step N" once a checkpoint is known to be on disk.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from cx_plugins import Booster, OptimizerWrapper
from cx_train.checkpoint._checkpointing import save_checkpoint
from cx_train.checkpoint._trainer_state import TrainerState
from cx_train.config._plugin_flags import LoraSettings

__all__ = ["RunSaves"]


class RunSaves:
    """`save` at each due step, `finish` before reporting what is saved, `wait_for_writes` on the way out."""

    def __init__(
        self,
        booster: Booster,
        model: nn.Module,
        optimizer: OptimizerWrapper,
        directory: Path | None,
        lr_scheduler: LRScheduler | None,
        master: bool,
        tokenizer: Any = None,
        lora: LoraSettings | None = None,
    ) -> None:
        self._booster = booster
        self._model = model
        self._optimizer = optimizer
        self._directory = directory
        self._scheduler = lr_scheduler
        self._master = master
        self._tokenizer = tokenizer  # its files go into each checkpoint's model/ folder
        self._lora = lora  # --lora-rank: the adapters are saved instead of the weights
        self._pending: int | None = None
        self.saved: int | None = None
        """The last step known to be on disk."""

    def save(self, state: TrainerState, config_text: str, final: bool) -> None:
        """Checkpoint `state.step` (collective): in the background unless `final`."""
        assert self._directory is not None, "saves need --save"
        save_checkpoint(
            self._booster,
            self._model,
            self._optimizer,
            self._directory,
            state,
            self._scheduler,
            config_text,
            use_async=not final,
            tokenizer=self._tokenizer,
            lora=self._lora,
        )
        self._confirm()  # the save waited for the previous one first
        self._pending = state.step
        if final:
            self._confirm()

    def finish(self) -> int | None:
        """Wait for the pending save (collective); return the last step saved."""
        self._booster.synchronize()
        self._confirm()
        return self.saved

    def _confirm(self) -> None:
        if self._pending is not None:
            self.saved, self._pending = self._pending, None
            if self._master:
                print(f"cx-train: saved step {self.saved} to {self._directory}", flush=True)

    def wait_for_writes(self) -> None:
        """Wait for this rank's background writes without communicating (on the way out of a run, an error
        included): no write outlives the run, nor the lock on its `--save` folder."""
        self._booster.checkpoint_io.wait_for_writes()
