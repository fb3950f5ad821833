"""The vocabulary range check after each layer's first calls (issue 37): later calls assert on the device instead
of reading min/max back, and a bad id is still refused with the IndexError naming it (on CPU the assert raises at
once, so the value is read then)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh.testing import count_host_reads, distributed
from cx_shardformer import VocabParallelEmbedding1D, cross_entropy_1d
from cx_shardformer._ids import EXACT_CALLS
from shardformer_helpers import chunk

V, H = 13, 6


@distributed(world_size=2)
def test_shardformer_ids_checked_on_device_after_the_first_calls(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    layer = VocabParallelEmbedding1D.from_native_module(nn.Embedding(V, H), None, make_vocab_size_divisible_by=4)
    ids = torch.randint(0, V, (2, 5))
    with count_host_reads() as reads:
        for _ in range(EXACT_CALLS):
            layer(ids)
        first = sum(n for site, n in reads.cx().items() if site.startswith("cx_shardformer._ids:"))
        reads.clear()
        layer(ids)
        later = {site: n for site, n in reads.cx().items() if site.startswith("cx_shardformer._ids:")}
    assert first == EXACT_CALLS, "the first calls read min/max once each"
    assert later == {}, f"a later call reads nothing on the host: {later}"
    ids[1, 2] = V + 3
    with pytest.raises(IndexError, match=f"input id {V + 3} is outside the vocabulary of size {V}"):
        layer(ids)


@distributed(world_size=2)
def test_shardformer_cross_entropy_1d_device_label_check_names_the_label(rank: int, world_size: int) -> None:
    torch.manual_seed(4)
    local = chunk(torch.randn(7, 16), -1, rank, world_size)
    labels = torch.randint(0, V, (7,))
    assert torch.isfinite(cross_entropy_1d(local, labels, vocab_size=V, exact_label_check=False))
    labels[3] = -1
    with pytest.raises(IndexError, match=f"label -1 is outside the vocabulary of size {V}"):
        cross_entropy_1d(local, labels, vocab_size=V, exact_label_check=False)
