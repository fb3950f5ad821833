"""The order `--data` windows are trained in, defined for the whole run and independent of the world size.

Epoch e visits the windows in a permutation seeded by (seed, e). The global batch is g = data-parallel size x
--batch-size windows; a step takes the next g windows of the epoch's order and data-parallel rank r trains on its
slice [r*b, (r+1)*b) of them (tp / pp / sp ranks of one replica have the same r, so the same samples). When fewer
than g windows are left in an epoch, the next epoch starts (the remainder is skipped). The position (epoch, windows
already taken in it) is what a checkpoint records: a run resumed from it, at any dp size with the same global batch,
takes the same next global batches as the run that never stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DataPosition", "WindowOrder"]


@dataclass(frozen=True)
class DataPosition:
    epoch: int = 0
    offset: int = 0  # windows of this epoch's order already trained on


class WindowOrder:
    """Global batches of window indices over `n_windows`, shuffled per epoch by `seed`."""

    def __init__(self, n_windows: int, global_batch: int, seed: int) -> None:
        if global_batch > n_windows:
            raise ValueError(
                f"the data has {n_windows} training windows, fewer than one global batch of {global_batch} "
                "(data-parallel size x --batch-size): add data or lower --batch-size / --seq-len"
            )
        self.n_windows, self.global_batch, self.seed = n_windows, global_batch, seed
        self._epoch: tuple[int, torch.Tensor] | None = None

    def steps_per_epoch(self) -> int:
        return self.n_windows // self.global_batch

    def position_at(self, step: int) -> DataPosition:
        """Where `step` steps of this global batch leave the data (for checkpoints that did not record it)."""
        epoch, done = divmod(step, self.steps_per_epoch())
        return DataPosition(epoch, done * self.global_batch)

    def order(self, epoch: int) -> torch.Tensor:
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._epoch = (epoch, torch.randperm(self.n_windows, generator=generator))
        return self._epoch[1]

    def take(self, position: DataPosition) -> tuple[torch.Tensor, DataPosition]:
        """The next global batch's window indices and the position after it."""
        if position.offset + self.global_batch > self.n_windows:
            position = DataPosition(position.epoch + 1, 0)
        end = position.offset + self.global_batch
        return self.order(position.epoch)[position.offset : end], DataPosition(position.epoch, end)

    @staticmethod
    def rank_slice(indices: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
        per_rank = indices.numel() // dp_size
        return indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]
