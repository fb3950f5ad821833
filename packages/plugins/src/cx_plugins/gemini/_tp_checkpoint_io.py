"""Checkpoint IO for the Gemini plugin with tensor parallelism: Gemini's own IO, with the TP adapter in between.

Gemini streams each parameter (and optimizer state) full over its zero group but still a TP shard; the
`TensorParallelShards` adapter gathers it over the TP group on the saving ranks (rank 0 of every zero group: one TP
group), strips the vocabulary padding, and cuts full tensors back into TP slices on load. The files are the
canonical cx format, the same as every other plugin's, so a Gemini tp2 checkpoint loads at tp 1, into LowLevelZero
or DDP, and back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cx_checkpoint import TensorSink, TensorSource
from cx_mesh import ProcessGroup
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards
from cx_plugins.gemini._checkpoint_io import GeminiCheckpointIO
from cx_zero import GeminiDDP, GeminiOptimizer

__all__ = ["GeminiTPCheckpointIO"]


class GeminiTPCheckpointIO(GeminiCheckpointIO):
    def __init__(
        self, gemini_of: Callable[[torch.optim.Optimizer], GeminiOptimizer | None], tp_group: ProcessGroup
    ) -> None:
        super().__init__(gemini_of)
        self._tp_group = tp_group

    def _shards(self, ddp: GeminiDDP) -> TensorParallelShards:
        local = {name: tuple(spec.shape) for name, spec in ddp.expected_tensors().items()}
        return TensorParallelShards.of_module(ddp.unwrap(), self._tp_group, local_shapes=local)

    def _full_model_state(self, ddp: GeminiDDP) -> dict[str, torch.Tensor]:
        shards = self._shards(ddp)
        state = super()._full_model_state(ddp)  # the same names in the same order on every saving TP rank
        return {name: shards.gather(name, tensor) for name, tensor in state.items()}

    def _model_source(self, ddp: GeminiDDP) -> TensorSource:
        return self._shards(ddp).source(ddp)

    def _ddp_sink(self, ddp: GeminiDDP) -> TensorSink:
        return self._shards(ddp).sink(ddp)

    def _optimizer_source(self, gemini: GeminiOptimizer) -> TensorSource:
        return self._shards(gemini.module).source(gemini)

    def _local_states(self, gemini: GeminiOptimizer, states: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        return self._shards(gemini.module).scatter_state(states)
