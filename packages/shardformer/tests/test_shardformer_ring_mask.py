"""`ring_mask`, the mask function registered for `cx_ring` attention, on the masks transformers composes
(`create_causal_mask`): packed documents (position_ids restarting) and padding become `KeySpans` allowing exactly what
sdpa's dense mask allows, a plain causal mask None (without a host read, issue 37), a mask with a hole in a row the
dense mask; blocks of rows (forced small) give the same spans. One process, no distributed group."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cx_mesh.testing import count_host_reads
from cx_shardformer import KeySpans
from cx_shardformer.policies import _ring_mask
from cx_shardformer.policies._sequence import _register_attention

pytest.importorskip("transformers")

S = 12


def _masks(**inputs: Any) -> tuple[Any, torch.Tensor | None]:
    """(cx_ring's mask, sdpa's mask) for the same inputs of a tiny Llama config."""
    import transformers
    from transformers.masking_utils import create_causal_mask

    _register_attention()
    config = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2)
    embeds = torch.zeros(2, S, 8)
    found = []
    for implementation in ("cx_ring", "sdpa"):
        config._attn_implementation = implementation
        found.append(create_causal_mask(config=config, inputs_embeds=embeds, cache=None, **inputs))
    return found[0], found[1]


def _dense(spans: KeySpans) -> torch.Tensor:
    positions = torch.arange(S)
    return spans.allowed(positions, positions)


def _packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ((5, 3, 4), (1, 6, 5))])


@pytest.mark.parametrize("block_elements", [1 << 24, 2 * S])
def test_shardformer_ring_mask_packed_documents_are_spans(monkeypatch: pytest.MonkeyPatch, block_elements: int) -> None:
    monkeypatch.setattr(_ring_mask, "_BLOCK_ELEMENTS", block_elements)  # 2 * S: one row per block
    ring, sdpa = _masks(attention_mask=None, position_ids=_packed_positions())
    assert isinstance(ring, KeySpans)
    assert sdpa is not None
    assert ring.causal
    assert ring.start[1].tolist() == [0] + [1] * 6 + [7] * 5
    assert torch.equal(_dense(ring), sdpa)


def test_shardformer_ring_mask_causal_padding_and_holes() -> None:
    with count_host_reads() as reads:
        ring, sdpa = _masks(attention_mask=None, position_ids=torch.arange(S).unsqueeze(0))
    assert ring is None  # plain causal: ring attention's own causal path, as SDPA's is_causal
    assert reads.cx() == {}  # known on the host from the mask function: nothing built, nothing read
    assert sdpa is None
    left = torch.ones(2, S, dtype=torch.long)
    left[0, :4] = 0
    ring, sdpa = _masks(attention_mask=left, position_ids=None)
    assert isinstance(ring, KeySpans)
    assert sdpa is not None
    assert torch.equal(_dense(ring), sdpa)
    hole = torch.ones(2, S, dtype=torch.long)
    hole[1, 5] = 0  # rows past 5 attend to keys on both sides of 5: not one range, so the dense mask
    ring, sdpa = _masks(attention_mask=hole, position_ids=None)
    assert isinstance(ring, torch.Tensor)
    assert sdpa is not None
    assert torch.equal(ring, sdpa)
