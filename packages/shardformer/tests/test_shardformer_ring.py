"""ring_attention on 2 and 4 ranks (zig-zag split, fully masked halves of blocks skipped) against plain causal
attention on the full sequence: outputs and the gradients of queries, keys and values, with grouped-query heads and
with an explicit boolean mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cx_mesh.testing import distributed
from cx_shardformer import KeySpans, ring_attention, zigzag_positions
from shardformer_helpers import assert_close

B, H, S, D = 2, 4, 16, 4


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("explicit_mask", [False, True])
def test_shardformer_ring_attention_matches_causal(
    rank: int, world_size: int, kv_heads: int, explicit_mask: bool
) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
    g = torch.randn(B, H, S, D)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    groups = H // kv_heads
    ref = F.scaled_dot_product_attention(
        q_ref, k_ref.repeat_interleave(groups, 1), v_ref.repeat_interleave(groups, 1), is_causal=True
    )
    (ref * g).sum().backward()

    pos = zigzag_positions(S, rank, world_size)
    assert len(pos) == S // world_size
    q_l, k_l, v_l = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    mask = torch.ones(S, S, dtype=torch.bool).tril().expand(B, 1, S, S) if explicit_mask else None
    out = ring_attention(q_l, k_l, v_l, None, D**-0.5, mask)
    assert_close(out, ref[:, :, pos].detach(), "output")
    (out * g[:, :, pos]).sum().backward()
    for name, local, full in (("q", q_l, q_ref), ("k", k_l, k_ref), ("v", v_l, v_ref)):
        assert local.grad is not None
        assert full.grad is not None
        assert_close(local.grad, full.grad[:, :, pos], f"{name} grad")


@distributed(world_size=2)
def test_shardformer_ring_zigzag_is_balanced_and_checked(rank: int, world_size: int) -> None:
    assert zigzag_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="not divisible by 2 \\* sequence parallel size = 4"):
        zigzag_positions(6, rank, world_size)


@distributed(world_size=2)
def test_shardformer_ring_attention_fully_masked_rows(rank: int, world_size: int) -> None:
    """Left padding under a causal mask: the first rows of batch 0 have no key to attend to. Ring attention gives
    them zero output and zero gradient (SDPA's result) instead of 0/0 = NaN, and the other rows match SDPA."""
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(B, H, S, D) for _ in range(4))
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[0, :5] = False  # 5 left-padding tokens: rows 0..4 of batch 0 see no key
    mask = (torch.ones(S, S, dtype=torch.bool).tril() & keep[:, None, :]).unsqueeze(1)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q_ref, k_ref, v_ref, attn_mask=mask)
    (ref * g).sum().backward()

    pos = zigzag_positions(S, rank, world_size)
    q_l, k_l, v_l = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q_l, k_l, v_l, None, D**-0.5, mask)
    assert_close(out, ref[:, :, pos].detach(), "output")
    empty = pos < 5
    assert torch.equal(out[0][:, empty], torch.zeros_like(out[0][:, empty])), "fully masked rows give zeros"
    (out * g[:, :, pos]).sum().backward()
    for name, local, full in (("q", q_l, q_ref), ("k", k_l, k_ref), ("v", v_l, v_ref)):
        assert local.grad is not None
        assert full.grad is not None
        assert bool(torch.isfinite(local.grad).all()), f"{name} grad is finite"
        assert_close(local.grad, full.grad[:, :, pos], f"{name} grad")


def _packed_spans(lengths: tuple[tuple[int, ...], ...]) -> tuple[KeySpans, torch.Tensor]:
    """Key spans of causal attention within packed documents, and the same mask dense [B, 1, S, S]."""
    document = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths])
    rows = torch.arange(document.shape[1])
    starts = torch.stack([torch.cat([torch.full((n,), sum(row[:i])) for i, n in enumerate(row)]) for row in lengths])
    spans = KeySpans(start=starts, stop=(rows + 1).expand_as(starts).clone(), causal=True)
    dense = (document[:, :, None] == document[:, None, :]) & (rows[:, None] >= rows[None, :])
    return spans, dense.unsqueeze(1)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_shardformer_ring_attention_packed_documents(rank: int, world_size: int, kv_heads: int) -> None:
    """Key spans of packed documents (causal within each, documents straddling the zig-zag chunks, with the skipped
    half-blocks) against SDPA with the dense block-diagonal causal mask: output and q/k/v gradients."""
    torch.manual_seed(0)
    spans, dense = _packed_spans(((5, 3, 8), (1, 6, 7, 2)))
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, kv_heads, S, D), torch.randn(B, kv_heads, S, D)
    g = torch.randn(B, H, S, D)
    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    groups = H // kv_heads
    ref = F.scaled_dot_product_attention(
        q_ref, k_ref.repeat_interleave(groups, 1), v_ref.repeat_interleave(groups, 1), attn_mask=dense
    )
    (ref * g).sum().backward()

    pos = zigzag_positions(S, rank, world_size)
    q_l, k_l, v_l = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q_l, k_l, v_l, None, D**-0.5, spans)
    assert_close(out, ref[:, :, pos].detach(), "output")
    (out * g[:, :, pos]).sum().backward()
    for name, local, full in (("q", q_l, q_ref), ("k", k_l, k_ref), ("v", v_l, v_ref)):
        assert local.grad is not None
        assert full.grad is not None
        assert_close(local.grad, full.grad[:, :, pos], f"{name} grad")
