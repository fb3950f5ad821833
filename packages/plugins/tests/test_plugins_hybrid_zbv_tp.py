"""The zero-bubble V schedule with tensor parallelism at more than two stages: tp 2 x pp 4 on eight ranks against
one process. Every rank runs its V order exactly as listed, so the two ranks of each tp pair run their weight-gradient
passes (which hold tp collectives) in the same order; cx once moved them by whether a message had arrived, which at
pp >= 3 could pair one rank's collective with another's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_pipeline import PipelineSchedule
from cx_plugins import HybridParallelPlugin
from cx_plugins._layout import Axis
from hybrid_test_helpers import llama, train_and_compare

pytest.importorskip("transformers")


@contextmanager
def _messages_arrive(always: bool, plugin: HybridParallelPlugin) -> Iterator[None]:
    """Make this rank's pipeline transport report every awaited message as arrived (`always`) or as not yet
    arrived: what timing can do to two tp peers, made deterministic. The runtime must not care."""
    schedule = plugin.schedule
    assert isinstance(schedule, PipelineSchedule)
    transport: Any = schedule._transport
    transport.ready = lambda stage, message: always
    try:
        yield
    finally:
        del transport.ready


@distributed(world_size=8, timeout=300)
def test_plugins_hybrid_zbv_tp2_pp4(rank: int, world_size: int) -> None:
    """Eight decoder layers, one per virtual stage; eight micro-batches (m = 2p: the hand-built V order); three steps,
    losses and every parameter compared. tp rank 0 sees every message as arrived, tp rank 1 none: the old runtime
    then ran tp rank 1's pending weight passes early and paired its tp all-reduces with rank 0's next forward's."""
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=4, pp_style="zbv", num_model_chunks=2, precision="fp32", num_microbatches=8
    )
    assert (plugin.tp_size, plugin.pp_size, plugin.dp_size) == (2, 4, 1)
    assert len(plugin.layout.ranks(Axis.PP)) == 4
    with _messages_arrive(dist.get_rank(plugin.tp_group) == 0, plugin):
        train_and_compare(plugin, model_fn=lambda: llama(8), steps=3)
