"""Ring attention over a sequence-parallel group, causal, on a balanced zig-zag split.

The sequence is cut into 2*sp chunks and rank r holds chunks r and 2*sp-1-r, so every rank has the same amount of
causal work. Each of sp steps attends the local queries to one rank's keys/values and passes those keys/values to
the next rank; after the first step half of every block is fully masked and skipped. Blocks merge with the running
log-sum-exp (flash-attention's online softmax). A query row whose keys are all masked (left padding) gets zero
output and passes no gradient, as torch's SDPA does. Packed documents (`KeySpans`: one range of keys per query) cut
each computed block at document boundaries from two [B, S] tensors, keeping the skipping, with no [S, S] mask. Like
flash attention, only the output and the log-sum-exp are kept for backward: it runs the ring again, recomputing each
block's probabilities, while the key/value gradients travel with their keys/values and arrive home after sp shifts.
Memory per rank is O(S/sp), not O(S^2/sp) (a dense `mask`, when given, is O(S^2) itself).
"""

from __future__ import annotations

from typing import Any

import torch

from cx_mesh import ProcessGroup
from cx_shardformer._comm import group_rank, group_size, shift_raw
from cx_shardformer._spans import KeySpans

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


_WHOLE = slice(None)


class _Plan:
    """Which rows (queries) and columns (keys) of step `step`'s block are computed, and how they are masked: by the
    dense `mask`, by the key `spans`, or (neither) causally. A causal mask or causal spans skip what a causal mask
    leaves fully masked after the first step; the spans then still cut the computed part at document boundaries."""

    def __init__(
        self,
        step: int,
        rank: int,
        world: int,
        local: int,
        mask: torch.Tensor | None,
        spans: KeySpans | None,
        device: Any,
    ) -> None:
        seq_len = local * world
        source = (rank - step) % world
        half = local // 2
        self.rows, self.cols = _WHOLE, _WHOLE
        self.q_pos = zigzag_positions(seq_len, rank, world, device)
        self.kv_pos = zigzag_positions(seq_len, source, world, device)
        self.mask, self.spans = mask, spans
        self.causal_cut = mask is None and spans is None and step == 0
        skips = mask is None and (spans is None or spans.causal)
        if not skips or step == 0:
            return
        if source < rank:
            # an earlier rank's first chunk precedes both local chunks and its second follows both: every query
            # sees (causally) exactly the first half of these keys
            self.cols = slice(0, half)
        else:
            # a later rank's chunks both follow the local first chunk and precede the local second chunk
            self.rows = slice(half, local)

    def scores(self, query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
        if self.mask is not None:
            cut = self.mask.index_select(-2, self.q_pos).index_select(-1, self.kv_pos)
            return scores.masked_fill(~cut, float("-inf")) if cut.dtype == torch.bool else scores + cut
        if self.spans is not None:
            allowed = self.spans.allowed(self.q_pos[self.rows], self.kv_pos[self.cols])
            return scores.masked_fill(~allowed, float("-inf"))
        if self.causal_cut:
            allowed = self.q_pos.unsqueeze(-1) >= self.kv_pos.unsqueeze(0)
            return scores.masked_fill(~allowed, float("-inf"))
        return scores


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Sum the gradient of expanded (grouped-query) heads back onto their key/value head."""
    if groups == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // groups, groups, length, dim).sum(dim=2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        group: ProcessGroup | None,
        scaling: float,
        mask: torch.Tensor | None,
        spans: KeySpans | None,
    ) -> torch.Tensor:
        world, rank = group_size(group), group_rank(group)
        q, k, v = query.float(), key.float(), value.float()
        local, groups = q.shape[2], q.shape[1] // k.shape[1]
        row_max = q.new_full((*q.shape[:-1], 1), -1e30)
        total = q.new_zeros((*q.shape[:-1], 1))
        out = torch.zeros_like(q)
        for step in range(world):
            plan = _Plan(step, rank, world, local, mask, spans, q.device)
            rows, cols = plan.rows, plan.cols
            k_block, v_block = _expand(k, groups)[:, :, cols], _expand(v, groups)[:, :, cols]
            scores = plan.scores(q[:, :, rows], k_block, scaling)
            new_max = torch.maximum(row_max[:, :, rows], scores.amax(dim=-1, keepdim=True).clamp(min=-1e30))
            decay = torch.exp(row_max[:, :, rows] - new_max)
            weights = torch.exp(scores - new_max)
            total[:, :, rows] = total[:, :, rows] * decay + weights.sum(dim=-1, keepdim=True)
            out[:, :, rows] = out[:, :, rows] * decay + torch.matmul(weights, v_block)
            row_max[:, :, rows] = new_max
            if step + 1 < world:
                k, v = shift_raw(k, 1, group), shift_raw(v, 1, group)
        # a query row whose every key is masked (left padding under a causal mask) has nothing to attend to: its
        # output is zero and its log-sum-exp -inf, as SDPA gives, instead of 0/0
        empty = total == 0
        out = out / torch.where(empty, torch.ones_like(total), total)
        lse = torch.where(empty, torch.full_like(total, float("-inf")), row_max + torch.log(total))
        ctx.save_for_backward(query, key, value, out, lse, mask)
        ctx.group, ctx.scaling, ctx.spans = group, scaling, spans
        return out.to(query.dtype)

    @staticmethod
    def backward(
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
        query, key, value, out, lse, mask = ctx.saved_tensors
        group, scaling, spans = ctx.group, ctx.scaling, ctx.spans
        world, rank = group_size(group), group_rank(group)
        q, k, v, d_out = query.float(), key.float(), value.float(), grad_out.float()
        local, groups = q.shape[2], q.shape[1] // k.shape[1]
        delta = (d_out * out).sum(dim=-1, keepdim=True)
        # fully masked rows (lse -inf): every probability exp(-inf - (+inf)) = 0, so they pass no gradient
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        d_q = torch.zeros_like(q)
        d_k, d_v = torch.zeros_like(k), torch.zeros_like(v)  # travel with k and v, home after `world` shifts
        for step in range(world):
            plan = _Plan(step, rank, world, local, mask, spans, q.device)
            rows, cols = plan.rows, plan.cols
            k_block, v_block = _expand(k, groups)[:, :, cols], _expand(v, groups)[:, :, cols]
            q_rows, d_rows = q[:, :, rows], d_out[:, :, rows]
            probs = torch.exp(plan.scores(q_rows, k_block, scaling) - lse[:, :, rows])
            d_v[:, :, cols] += _fold(torch.matmul(probs.transpose(-1, -2), d_rows), groups)
            d_scores = probs * (torch.matmul(d_rows, v_block.transpose(-1, -2)) - delta[:, :, rows])
            d_q[:, :, rows] += torch.matmul(d_scores, k_block) * scaling
            d_k[:, :, cols] += _fold(torch.matmul(d_scores.transpose(-1, -2), q_rows) * scaling, groups)
            if step + 1 < world:
                k, v = shift_raw(k, 1, group), shift_raw(v, 1, group)
            d_k, d_v = shift_raw(d_k, 1, group), shift_raw(d_v, 1, group)
        return d_q.to(query.dtype), d_k.to(key.dtype), d_v.to(value.dtype), None, None, None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: ProcessGroup | None,
    scaling: float,
    mask: torch.Tensor | KeySpans | None = None,
) -> torch.Tensor:
    """Causal attention of local zig-zag queries [B, H, S_l, D] against every rank's keys/values [B, Hkv, S_l, D]
    (grouped-query heads expanded per block). `mask` is optional: a full [B, 1|H, S, S] mask (bool: True attends;
    float: added) indexed by global positions, or `KeySpans` (one contiguous range of keys per row, e.g. causal
    attention within packed documents: [B, S] each, no [S, S] tensor); without it the mask is causal. A query row with
    every key masked (bool False, an empty span, or an additive value that underflows every weight) gives zeros.
    Returns [B, H, S_l, D]."""
    zigzag_positions(query.shape[2] * group_size(group), group_rank(group), group_size(group))  # checks the length
    spans = mask if isinstance(mask, KeySpans) else None
    dense = mask if isinstance(mask, torch.Tensor) else None
    out: torch.Tensor = _RingAttention.apply(query, key, value, group, scaling, dense, spans)
    return out
