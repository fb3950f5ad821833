"""The collectives one training step of a `Candidate` runs, each with the bytes one rank sends and the number of
latency-bound hops, the group it runs in and how many consecutive ranks that group spans (which link it crosses).

Volumes are the ring algorithms' (what NCCL and gloo run for large messages): an all-reduce of S bytes over n ranks
sends 2(n-1)/n x S per rank in 2(n-1) hops; an all-gather or reduce-scatter of a full size S sends (n-1)/n x S in
n-1 hops; an all-to-all sends (n-1)/n of the local tensor in n-1 hops. Per step and rank:

- data parallelism: DDP / hybrid zero 0 all-reduce the gradients once per step; ZeRO-1/2 reduce-scatter them and
  all-gather the updated 16-bit weights; ZeRO-3 (FSDP, Gemini) all-gathers the weights for every forward and every
  backward of each micro-batch and reduce-scatters the gradients (FSDP under bf16/fp16 gathers 16-bit weights and
  reduces fp32 gradients, cx-train's MixedPrecision policy). Dense parameters reduce over dp x sp (the ranks that
  see other tokens), routed experts over moe_dp only. Buckets of 25 MB set the number of calls.
- tensor parallelism (Megatron): two all-reduces of the layer's [tokens, hidden] activation per decoder layer in
  the forward and two in the backward (split_gather / ring sequence parallelism turns each into an all-gather plus
  a reduce-scatter: the same bytes), plus one in each direction for the vocabulary-parallel embedding.
- sequence parallelism on the sp axis: Ulysses (all_to_all) moves q, k, v and the attention output with four
  all-to-alls per layer each way; ring attention passes k and v around the ring (sp - 1 hops), and in the backward
  also their gradients.
- experts: dispatch and combine all-to-alls of the routed token copies (top_k x tokens x capacity factor) per MoE
  layer, forward and backward; under routing skew at the hottest rank's load (`hot_rank_load` x: it receives
  that many rows in the dispatch and sends them back in the combine, and the all-to-all ends when it does).
- pipeline: one activation forward and one gradient backward per micro-batch, model chunk and stage boundary.
- optimizer muon where whole parameters have owners (`_muon_split.whole_group`: ZeRO 1/2, Gemini, hybrid tp at
  ZeRO 0): every rank sends its slices of the stage's gradients to their owners (one gather per owner, fp32, the
  master dtype; Gemini sends the master beside them) and gets its slices of the updates back (one scatter per
  owner): each an all-gather-sized volume of the stage's whole-stepped parameters in fp32, after the backward (not
  overlapped): under LowLevelZero's ZeRO 1/2 the Muon matrices only (the AdamW groups step on the shards,
  `_muon_split.adamw_on_shards`), under Gemini and tp at ZeRO 0 every parameter; under TorchFSDPPlugin the Muon
  matrices' bf16 updates (`_muon_split.fsdp_rows`); hybrid ZeRO 1/2 at tp > 1 the Muon tp slices over dp, then the
  dp owner's share of the matrices over tp (`_muon_split.tp_zero_owners`); Gemini at tp > 1 alike (each rank's tp
  slices over dp, then the dp owner's share over tp), master beside gradient in both gathers (`_tp_whole` regathers
  the masters every step);
  MoeHybridParallelPlugin at tp > 1 gathers no routed experts (replicated over tp, each rank steps its own).

Activation checkpointing repeats a recomputed layer's forward collectives (tp, sp, experts) once more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cx_plan._candidate import Candidate
from cx_plan.trace._model_spec import ModelShape
from cx_plan.trace._muon_split import (
    adamw_on_shards,
    experts_stepped_locally,
    fsdp_rows,
    muon_split,
    tp_zero_owners,
    whole_group,
)
from cx_plan.trace._oracle import hot_rank_load

__all__ = ["BUCKET_BYTES", "Collective", "step_collectives", "weight_bytes"]

BUCKET_BYTES = 25 * 2**20  # DDP's and ZeRO's default bucket (ddp_bucket_cap_mb=25): one call per bucket
_FP32 = 4
_OWN_PRECISION = ("gemini", "low_level_zero", "hybrid", "moe_hybrid")  # 16-bit weights and gradients, fp32 master


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: `bytes` one rank sends in all its calls, `hops` latency-bound steps in all
    its calls, over a group of `group_size` ranks lying within `span` consecutive global ranks; `pipelined` ones
    are the pipeline's p2p transfers (timed inside the schedule simulation, not added to the step); `ring` ones
    are NCCL ring collectives (all-reduce, all-gather, reduce-scatter), whose rings share a node's NICs
    (`Network.ring_bandwidth`, which counts the ranks per node of every group along `axes`, (size, stride) each,
    among `world` ranks)."""

    name: str
    group_size: int
    span: int
    bytes: float
    hops: int
    pipelined: bool = False
    ring: bool = False
    axes: tuple[tuple[int, int], ...] = ()
    world: int = 1

    def __post_init__(self) -> None:
        if self.ring and self.group_size > 1 and not self.axes:
            raise ValueError(f"ring collective {self.name!r} needs its group's layout axes (size, stride)")


def weight_bytes(candidate: Candidate) -> int:
    """Bytes of one weight or gradient element as the plugin computes with it (16-bit under the plugins that keep
    fp32 master weights; DDP and FSDP here train fp32 parameters under autocast)."""
    return 2 if candidate.half_precision and candidate.plugin in _OWN_PRECISION else 4


def _activation_bytes(candidate: Candidate) -> int:
    return 2 if candidate.half_precision else 4


def _strides(candidate: Candidate) -> dict[str, tuple[int, int]]:
    """(size, stride) of each axis in the plugin's mesh order, ranks row-major (hybrid: dp, pp, tp, sp; MoE hybrid:
    moe_dp, pp, ep, tp, sp; the data-parallel plugins: dp)."""
    c = candidate
    if c.plugin == "moe_hybrid":
        order = [("moe_dp", c.moe_dp), ("pp", c.pp), ("ep", c.ep), ("tp", c.tp), ("sp", c.sp)]
    else:
        order = [("dp", c.dp), ("pp", c.pp), ("tp", c.tp), ("sp", c.sp)]
    strides: dict[str, tuple[int, int]] = {}
    stride = 1
    for name, size in reversed(order):
        strides[name] = (size, stride)
        stride *= size
    return strides


def _group(candidate: Candidate, *axes: str) -> tuple[int, int]:
    """(size, span) of the group along `axes` taken together."""
    strides = _strides(candidate)
    size = math.prod(strides[a][0] for a in axes if a in strides)
    span = 1 + sum((strides[a][0] - 1) * strides[a][1] for a in axes if a in strides)
    return size, span


def _layout(candidate: Candidate, *axes: str) -> tuple[tuple[tuple[int, int], ...], int]:
    """A ring collective's group layout: the (size, stride) of its axes and the world (`Network.ring_bandwidth`)."""
    strides = _strides(candidate)
    found = tuple(strides[a] for a in axes if a in strides and strides[a][0] > 1)
    return found, math.prod(size for size, _ in strides.values())


def _ring_collective(candidate: Candidate, name: str, axes: tuple[str, ...], moved: float, hops: int) -> Collective:
    """A ring collective (all-reduce, all-gather, reduce-scatter) over the group along `axes`, with the layout
    `Network.ring_bandwidth` needs."""
    size, span = _group(candidate, *axes)
    layout, world = _layout(candidate, *axes)
    return Collective(name, size, span, moved, hops, ring=True, axes=layout, world=world)


def _ring(size: int, full_bytes: float, calls: int, kind: str) -> tuple[float, int]:
    """(bytes sent per rank, hops) of `calls` ring collectives of `kind` moving `full_bytes` in all."""
    if size <= 1:
        return 0.0, 0
    if kind == "all_reduce":
        return 2 * (size - 1) / size * full_bytes, 2 * (size - 1) * calls
    return (size - 1) / size * full_bytes, (size - 1) * calls  # all_gather, reduce_scatter, all_to_all


def _data_parallel(candidate: Candidate, shape: ModelShape) -> list[Collective]:
    c, counts = candidate, shape.parameters
    w = weight_bytes(c)
    # FSDP under mixed precision gathers 16-bit weights but reduces fp32 gradients (cx-train's MixedPrecision policy)
    gathered = 2 if c.half_precision and c.plugin == "torch_fsdp" else w
    dense = counts.dense / (c.tp * c.pp)
    experts = counts.experts / (c.ep * c.pp)
    groups: list[tuple[str, float, tuple[str, ...]]] = [("dense", dense + experts, ("dp", "sp"))]
    if c.plugin == "moe_hybrid":  # otherwise the experts are parameters like the rest (replicated over tp)
        groups = [("dense", dense, ("moe_dp", "ep", "sp")), ("experts", experts, ("moe_dp",))]
    found = []
    for label, parameters, axes in groups:
        size, _ = _group(c, *axes)
        if size <= 1 or parameters == 0:
            continue
        full = parameters * w
        calls = max(1, math.ceil(full / BUCKET_BYTES))
        if c.plugin == "torch_fsdp":  # FSDP2: one collective per unit and pass, whatever its size (no buckets)
            calls = shape.num_layers + 1 if c.fsdp_wrap == "block" else 1
        if c.stage == 0:
            moved, hops = _ring(size, full, calls, "all_reduce")
            found.append(_ring_collective(c, f"{label} gradient all-reduce", axes, moved, hops))
            continue
        moved, hops = _ring(size, full, calls, "reduce_scatter")
        found.append(_ring_collective(c, f"{label} gradient reduce-scatter", axes, moved, hops))
        gathers = 1 if c.stage < 3 else 2 * c.num_microbatches  # ZeRO-3: every forward and backward
        moved, hops = _ring(size, parameters * gathered * gathers, calls * gathers, "all_gather")
        found.append(_ring_collective(c, f"{label} weight all-gather", axes, moved, hops))
    return found


def _in_layer(candidate: Candidate, shape: ModelShape, seq_len: int) -> list[Collective]:
    """tp, sp and expert collectives of every micro-batch (forward, backward and recomputed forward)."""
    c = candidate
    a = _activation_bytes(c)
    tokens = c.micro_batch_size * seq_len / c.sp  # tokens one rank holds between attention blocks (sp axis)
    layers = shape.num_layers / c.pp
    passes = 2 + c.checkpoint_ratio  # forward, backward, and the recomputed share of forwards
    m = c.num_microbatches
    found = []
    if c.tp > 1:
        calls = round(m * (2 * layers * passes + 2))
        moved, hops = _ring(c.tp, calls * tokens * shape.hidden_size * a, calls, "all_reduce")
        found.append(_ring_collective(c, "tp activation all-reduce", ("tp",), moved, hops))
    if c.sp > 1:
        size, span = _group(c, "sp")
        kv = shape.num_kv_heads * shape.head_dim
        if c.sp_mode == "all_to_all":
            per_layer = tokens * (2 * shape.num_heads * shape.head_dim + 2 * kv) * a  # q, out; k, v
            calls = round(m * layers * 4 * passes)
            moved, hops = _ring(size, m * layers * passes * per_layer, calls, "all_to_all")
            found.append(Collective("sp (Ulysses) all-to-all", size, span, moved, hops))
        else:  # ring attention: k, v pass sp - 1 hops; the backward passes their gradients too
            per_hop = tokens * 2 * kv * a
            rounds = m * layers * (1 + 2 + c.checkpoint_ratio)
            found.append(
                Collective(
                    "sp ring-attention k/v", size, span, rounds * (size - 1) * per_hop, round(rounds) * (size - 1)
                )
            )
    moe_layers = sum(1 for e in shape.parameters.experts_per_layer if e) / c.pp
    if c.ep > 1 and moe_layers:
        size, span = _group(c, "ep")
        load = hot_rank_load(c.routing_skew, c.ep, shape.num_experts, shape.top_k)
        copies = tokens * shape.top_k * shape.hidden_size * a * load  # capacity factor 1: routed copies, dropless
        calls = round(m * moe_layers * 2 * passes)  # dispatch and combine
        moved, hops = _ring(size, calls * copies, calls, "all_to_all")
        found.append(Collective("expert dispatch/combine all-to-all", size, span, moved, hops))
    if c.pp > 1:
        size, span = _group(c, "pp")
        # the hidden state between stages, per micro-batch and chunk, forward and backward (each rank sends
        # whole tensors; under sp each rank its shard)
        message = c.micro_batch_size * seq_len / c.sequence_split * shape.hidden_size * a
        calls = 2 * m * c.num_model_chunks
        found.append(Collective("pipeline p2p", size, span, calls * message, calls, pipelined=True))
    return found


def _whole_matrices(candidate: Candidate, shape: ModelShape) -> list[Collective]:
    """MuonWithAdamW's gather of gradients to their owners and scatter of updates back (module docstring)."""
    c = candidate
    size = whole_group(c)
    if not c.muon or size <= 1:
        return []
    counts = shape.parameters
    experts = 0.0 if experts_stepped_locally(c) else counts.experts / c.ep  # replicated over tp: not gathered
    elements = (counts.dense + experts) / c.pp  # the stage's parameters, whole
    if adamw_on_shards(c) or fsdp_rows(c):  # only the Muon matrices travel to owners (their share of the elements)
        split = muon_split(shape)
        elements *= split.muon_elements / split.total if split.total else 0.0
    axes: tuple[str, ...] = ("tp",) if c.stage == 0 and c.plugin not in ("gemini", "torch_fsdp") else ("dp", "sp")
    if c.plugin == "moe_hybrid" and axes != ("tp",):
        axes = ("moe_dp", "ep", "sp")
    _, span = _group(c, *axes)
    sent = (size - 1) / size * elements * (2 if fsdp_rows(c) else _FP32)  # FSDP: bf16 updates both ways
    if tp_zero_owners(c) or (c.plugin == "gemini" and c.tp > 1):  # tp slices over dp; then a dp owner's over tp
        _, tp_span = _group(c, "tp")
        over_tp = (c.tp - 1) / c.tp * elements / size * _FP32
        both = 2 if c.plugin == "gemini" else 1  # Gemini gathers the master beside the gradient
        return [
            Collective("muon gradient gather", size, span, both * sent / c.tp, size),
            Collective("muon weight scatter", size, span, sent / c.tp, size),
            Collective("muon tp gradient gather", c.tp, tp_span, both * over_tp, c.tp),
            Collective("muon tp weight scatter", c.tp, tp_span, over_tp, c.tp),
        ]
    return [
        Collective("muon gradient gather", size, span, sent * (2 if c.plugin == "gemini" else 1), size),
        Collective("muon weight scatter", size, span, sent, size),
    ]


def step_collectives(candidate: Candidate, shape: ModelShape, seq_len: int) -> list[Collective]:
    """Every collective one rank runs in one optimizer step of `candidate` training `shape` on `seq_len` tokens."""
    c = candidate
    return [*_in_layer(c, shape, seq_len), *_data_parallel(c, shape), *_whole_matrices(c, shape)]
