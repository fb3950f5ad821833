"""`--data` in the training loop: a loader shaped like the plugin's DataLoader (`len`, `sampler.set_epoch`, one
epoch per iteration), so the loop's epoch / mid-epoch skip logic drives it, but whose batches follow `_data_order`'s
world-size independent order, sliced by the plugin's data-parallel rank. Also: the data position written to
`trainer.json`, the check that a resumed run continues at the recorded position, and the periodic evaluation.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_train.checkpoint._trainer_state import TrainerState, read_trainer_state
from cx_train.config._options import TrainOptions
from cx_train.config._resumed_model import embedded_text_message
from cx_train.data._order import DataPosition, WindowOrder
from cx_train.data._packing import PackedBatch
from cx_train.data._text_sources import DataError
from cx_train.data._tokenizers import ByteTokenizer
from cx_train.data._user_data import UserData, open_user_data
from cx_train.models._spec import DescribedModel
from cx_train.step._evaluation import EvalResult, evaluate

__all__ = ["UserLoader", "data_parallel", "open_loader"]


def data_parallel(plugin: Any) -> tuple[int, int]:
    """(rank, size) along the plugin's data-parallel dimension (tp / pp / sp ranks of one replica share it)."""
    ranks = getattr(plugin, "data_parallel_rank_and_size", None)
    if ranks is None:
        return dist.get_rank(), dist.get_world_size()
    rank, size = ranks()
    return int(rank), int(size)


class UserLoader:
    def __init__(self, data: UserData, options: TrainOptions, dp: tuple[int, int]) -> None:
        self.data, self.options, self.dp = data, options, dp
        self.order = WindowOrder(len(data.train), dp[1] * options.batch_size, options.seed)
        self.sampler = self
        self.epoch = 0
        self.grad_accum = int(getattr(options, "grad_accum", 1))  # micro-batches per step (--grad-accum)
        self.last_eval: EvalResult | None = None  # the latest evaluation, for a metrics log

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.order.steps_per_epoch()

    def __iter__(self) -> Iterator[PackedBatch]:
        position = DataPosition(self.epoch, 0)
        for _ in range(len(self)):
            indices, position = self.order.take(position)
            yield self.data.train.batch(WindowOrder.rank_slice(indices, *self.dp))

    def position_after(self, step: int) -> DataPosition:
        return self.order.position_at(step * self.grad_accum)

    def with_position(self, state: TrainerState) -> TrainerState:
        """`state` with the data position after its step (what `trainer.json` records)."""
        position = self.position_after(state.step)
        return replace(state, data_epoch=position.epoch, data_offset=position.offset)

    def check_resume(self) -> None:
        """A resumed run continues where the checkpoint's data stopped: refuse a global batch that lands elsewhere."""
        if self.options.resume is None:
            return
        state = read_trainer_state(self.options.resume)
        if state.data_epoch is None or state.data_offset is None:  # trained on the embedded text
            if isinstance(self.data.tokenizer, ByteTokenizer):
                raise DataError(embedded_text_message(self.options.resume, self.options.model))
            return  # a model folder's own tokenizer: the same ids, so training continues on the new data
        recorded = DataPosition(state.data_epoch, state.data_offset)
        here = self.position_after(state.step)
        if recorded != here:
            raise DataError(
                f"--resume {self.options.resume}: the checkpoint stopped at window {recorded.offset} of epoch "
                f"{recorded.epoch}, but step {state.step} with this run's global batch of "
                f"{self.order.global_batch * self.grad_accum} windows (data-parallel size x --batch-size x "
                f"--grad-accum) is at window {here.offset} of epoch {here.epoch}: resume with the global batch of the "
                "run that saved it, and the same --data, --seq-len and --seed"
            )

    def maybe_evaluate(self, model: nn.Module, described: DescribedModel, step: int, device: torch.device) -> None:
        """Evaluate every --eval-every steps and at the last step (collective); rank 0 prints the result."""
        every, last = self.options.eval_every, step == self.options.steps
        if self.data.evaluation is None or not (last or (every and step % every == 0)):
            return
        self.last_eval = evaluate(model, self.data, described, self.options.batch_size, self.dp, device, step)
        if dist.get_rank() == 0:
            print(self.last_eval.line(), flush=True)


def open_loader(options: TrainOptions, plugin: Any) -> UserLoader:
    """The `--data` loader of this rank (the cache is normally built already: parse_options tokenised it)."""
    assert options.data is not None
    data = open_user_data(options.data, options.model, options.model_spec.is_folder, options.window_length)
    loader = UserLoader(data, options, data_parallel(plugin))
    loader.check_resume()
    return loader
