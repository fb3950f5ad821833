"""Ring attention over a sequence-parallel group, causal, on a balanced zig-zag split.

The sequence is cut into 2*sp chunks and rank r holds chunks r and 2*sp-1-r, so every rank has the same amount of
causal work. Each of sp steps attends the local queries to one rank's keys/values and passes those keys/values to
the next rank (`ring_shift`: forward send/recv, backward the other way). Blocks are merged with the running
log-sum-exp (flash-attention's online softmax), written with plain torch ops so autograd gives the backward.
"""

from __future__ import annotations

import torch

from cx_mesh import ProcessGroup
from cx_shardformer._comm import group_rank, group_size, ring_shift

__all__ = ["ring_attention", "zigzag_positions"]


def zigzag_positions(seq_len: int, rank: int, world: int, device: torch.device | None = None) -> torch.Tensor:
    """Global positions of rank `rank`'s tokens under the zig-zag split of `seq_len` over `world` ranks."""
    if seq_len % (2 * world) != 0:
        raise ValueError(
            f"ring attention: sequence length {seq_len} is not divisible by 2 * sequence parallel size = "
            f"{2 * world} (the balanced zig-zag split cuts it into {2 * world} equal chunks)"
        )
    chunk = seq_len // (2 * world)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk, device=device)
    return torch.cat([first, second])


def zigzag_order(seq_len: int, world: int, device: torch.device | None = None) -> torch.Tensor:
    """All ranks' positions concatenated in rank order (a permutation of range(seq_len))."""
    return torch.cat([zigzag_positions(seq_len, r, world, device) for r in range(world)])


_Block = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    q_pos: torch.Tensor | None,
    kv_pos: torch.Tensor | None,
    mask: torch.Tensor | None,
) -> _Block:
    """One block's row maxima (detached: a stabiliser only), sums of exponentials and unnormalised outputs."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if mask is not None and q_pos is not None and kv_pos is not None:
        cut = mask.index_select(-2, q_pos).index_select(-1, kv_pos)
        scores = scores.masked_fill(~cut, float("-inf")) if cut.dtype == torch.bool else scores + cut
    elif q_pos is not None and kv_pos is not None:
        allowed = q_pos.unsqueeze(-1) >= kv_pos.unsqueeze(0)
        scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.detach().amax(dim=-1, keepdim=True).clamp(min=-1e30)
    weights = torch.exp(scores - row_max)
    return row_max, weights.sum(dim=-1, keepdim=True), torch.matmul(weights, value)


def _pad_front(block: _Block, rows: int) -> _Block:
    """Give `rows` leading queries an empty contribution (maximum -1e30, sum 0, output 0)."""
    row_max, total, out = block
    shape = (*row_max.shape[:-2], rows, 1)
    return (
        torch.cat([row_max.new_full(shape, -1e30), row_max], dim=-2),
        torch.cat([total.new_zeros(shape), total], dim=-2),
        torch.cat([out.new_zeros((*out.shape[:-2], rows, out.shape[-1])), out], dim=-2),
    )


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: ProcessGroup | None,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of local zig-zag queries [B, H, S_l, D] against every rank's keys/values [B, Hkv, S_l, D]
    (grouped-query heads expanded per block). `mask` is an optional full [B, 1|H, S, S] mask (bool: True attends;
    float: added) indexed by global positions; without it the mask is causal. Returns [B, H, S_l, D]."""
    world, rank = group_size(group), group_rank(group)
    local = query.shape[2]
    seq_len = local * world
    q_pos = zigzag_positions(seq_len, rank, world, query.device)
    groups = query.shape[1] // key.shape[1]
    maxima: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    half = local // 2
    k, v = key, value
    for step in range(world):
        source = (rank - step) % world
        k_full = k.repeat_interleave(groups, dim=1) if groups > 1 else k
        v_full = v.repeat_interleave(groups, dim=1) if groups > 1 else v
        if mask is not None or step == 0:
            kv_pos = zigzag_positions(seq_len, source, world, query.device)
            block = _block(query, k_full, v_full, scaling, q_pos, kv_pos, mask)
        elif source < rank:
            # the zig-zag balance: an earlier rank's first chunk precedes both local chunks and its second chunk
            # follows both, so every query sees exactly the first half of these keys, unmasked
            block = _block(query, k_full[:, :, :half], v_full[:, :, :half], scaling, None, None, None)
        else:
            # a later rank's chunks both precede the local second chunk and both follow the local first chunk
            tail = _block(query[:, :, half:], k_full, v_full, scaling, None, None, None)
            block = _pad_front(tail, half)
        maxima.append(block[0])
        sums.append(block[1])
        outs.append(block[2])
        if step + 1 < world:
            k, v = ring_shift(k, group), ring_shift(v, group)
    top = torch.stack(maxima).amax(dim=0)
    numerator = sum(torch.exp(m - top) * o for m, o in zip(maxima, outs, strict=True))
    denominator = sum(torch.exp(m - top) * s for m, s in zip(maxima, sums, strict=True))
    assert isinstance(numerator, torch.Tensor)
    assert isinstance(denominator, torch.Tensor)
    return numerator / denominator
