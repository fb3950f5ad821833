"""The model's parameters as cx-train's `--optimizer muon` groups them, and what one rank of a group holds and
computes when cx steps them whole (`muon_split`, `owner_loads`).

cx-train's MuonWithAdamW takes `cx_zero.muon_param_groups(model)`: 2-D hidden matrices (and fused expert stacks) get
Muon's one fp32 momentum buffer, 1-D parameters, embeddings and the output head AdamW's two fp32 moments (Muon keeps
fp32 states: bf16 states are refused). The optimizer is whole-tensor, so where a plugin shards parameters each Muon
parameter gets one owner rank of the group (`cx_zero.assign_owners`, balanced by Newton-Schulz cost, not by bytes) that
keeps its whole fp32 master and its state, and steps it. Its AdamW groups are elementwise
(`cx_zero.elementwise_groups`): LowLevelZero (ZeRO 1/2 of low_level_zero, hybrid, moe_hybrid) steps them on its flat
shards, each rank 1/dp of their states (`adamw_on_shards`, `rank_load`); Gemini and tensor parallelism at ZeRO 0 give
them owners too, as the Muon parameters. Newton-Schulz runs `ns_steps` (torch.optim.Muon's 5) iterations of X X^T,
(A @ A) and B @ X on each m x n matrix (m <= n): 2 m^2 n + 2 m^3 + 2 m^2 n FLOPs each; a 3-D expert stack
orthogonalises each expert's matrix on its own. MoeHybridParallelPlugin at tp > 1 (ZeRO 0) keeps the routed experts
replicated over tp (cx's MoE policies), so every tp rank steps its own whole expert stacks and only the other
parameters get owners over tp (`experts_stepped_locally`). TorchFSDPPlugin keeps every state on its row shards and
gathers only each Muon matrix's bf16 update to its owner for Newton-Schulz (`fsdp_rows`). HybridParallelPlugin at
ZeRO 1/2 with tp > 1 has two owners per matrix: a dp owner of each tp slice, then a tp owner of the whole matrix
(`tp_zero_owners`, `two_level_loads`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from cx_plan._candidate import Candidate
from cx_plan.trace._model_spec import ModelShape, build_model, is_routed_expert
from cx_zero import MUON_DEFAULTS, assign_owners, muon_param_groups

__all__ = [
    "ADAMW_STATE_BYTES",
    "MUON_STATE_BYTES",
    "MuonSplit",
    "OwnerLoad",
    "adamw_on_shards",
    "busiest_owner",
    "experts_stepped_locally",
    "fsdp_rows",
    "tp_zero_owners",
    "two_level_loads",
    "muon_on_host",
    "muon_split",
    "ns_flops",
    "owner_loads",
    "rank_load",
    "stepped_load",
    "whole_group",
]

MUON_STATE_BYTES = 4  # one fp32 momentum buffer per element
ADAMW_STATE_BYTES = 8  # exp_avg and exp_avg_sq, fp32
NS_STEPS: int = MUON_DEFAULTS["ns_steps"]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """Newton-Schulz FLOPs of one Muon update of a parameter of `shape` (2-D, or a 3-D stack of matrices)."""
    dims = list(shape)
    if len(dims) < 2:
        return 0
    stack = dims[0] if len(dims) == 3 else 1
    rows, cols = dims[-2], dims[-1]
    m, n = min(rows, cols), max(rows, cols)
    return stack * steps * (4 * m * m * n + 2 * m**3)


@dataclass(frozen=True)
class MuonSplit:
    """Every trained parameter's shape (shared ones once, model order), whether Muon steps it and whether it is a
    routed expert's."""

    shapes: tuple[tuple[int, ...], ...]
    muon: tuple[bool, ...]
    expert: tuple[bool, ...]

    def part(self, expert: bool) -> MuonSplit:
        """The routed experts' parameters (`expert`) or the others, as a split of their own."""
        keep = [i for i, flag in enumerate(self.expert) if flag == expert]
        return MuonSplit(
            tuple(self.shapes[i] for i in keep), tuple(self.muon[i] for i in keep), tuple(expert for _ in keep)
        )

    @property
    def total(self) -> int:
        return sum(_numel(shape) for shape in self.shapes)

    @property
    def muon_elements(self) -> int:
        return sum(_numel(shape) for shape, m in zip(self.shapes, self.muon, strict=True) if m)

    @property
    def state_bytes(self) -> int:
        """Muon's and AdamW's fp32 states over the whole model."""
        pairs = zip(self.shapes, self.muon, strict=True)
        return sum(_numel(shape) * (MUON_STATE_BYTES if m else ADAMW_STATE_BYTES) for shape, m in pairs)

    def adamw_shard_elements(self, group_size: int) -> int:
        """One rank's elements of the AdamW parameters split over `group_size` ranks, each padded to a multiple of it
        (cx-zero's flat shards)."""
        pairs = zip(self.shapes, self.muon, strict=True)
        return sum(-(-_numel(shape) // group_size) for shape, m in pairs if not m)

    @property
    def adamw_state_bytes(self) -> int:
        """AdamW's two fp32 moments over every parameter (what `--optimizer adamw` holds)."""
        return ADAMW_STATE_BYTES * self.total


@dataclass(frozen=True)
class OwnerLoad:
    """What one owner rank of a group steps: elements (its whole fp32 masters and gathered gradients), the states
    of those (and of its AdamW shards), the largest Muon matrix's elements, the Newton-Schulz FLOPs, and the AdamW
    elements it steps on flat shards (no whole master, no gather: `adamw_on_shards`)."""

    elements: int
    state_bytes: int
    muon_elements: int
    largest_matrix: tuple[int, int]  # (m, n) of its largest Muon matrix, m <= n; (0, 0) when it owns none
    ns_flops: int
    sharded_elements: int = 0


def _load(split: MuonSplit, indices: Sequence[int]) -> OwnerLoad:
    elements = state = muon = flops = 0
    largest = (0, 0)
    for i in indices:
        numel = _numel(split.shapes[i])
        elements += numel
        state += numel * (MUON_STATE_BYTES if split.muon[i] else ADAMW_STATE_BYTES)
        if split.muon[i]:
            muon += numel
            flops += ns_flops(split.shapes[i])
            rows, cols = split.shapes[i][-2:]
            if rows * cols > largest[0] * largest[1]:
                largest = (min(rows, cols), max(rows, cols))
    return OwnerLoad(elements, state, muon, largest, flops)


@functools.lru_cache(maxsize=64)
def owner_loads(split: MuonSplit, group_size: int, muon_only: bool = False) -> tuple[OwnerLoad, ...]:
    """Each group rank's load when cx assigns the parameters owners over `group_size` ranks (one rank: all);
    `muon_only`: only the Muon parameters get owners (cx-zero assigns them among those alone)."""
    whole = [i for i, m in enumerate(split.muon) if m or not muon_only]
    shapes = [split.shapes[i] for i in whole]
    owners = assign_owners(shapes, group_size) if group_size > 1 else [0] * len(whole)
    by_rank = [[i for i, o in zip(whole, owners, strict=True) if o == rank] for rank in range(group_size)]
    return tuple(_load(split, indices) for indices in by_rank)


def busiest_owner(split: MuonSplit, group_size: int, muon_only: bool = False) -> OwnerLoad:
    """The owner holding the most bytes at the step (states, whole master and whole gradient)."""
    loads = owner_loads(split, group_size, muon_only)
    return max(loads, key=lambda load: (load.state_bytes + 8 * load.elements, load.ns_flops))


def adamw_on_shards(c: Candidate) -> bool:
    """Whether the AdamW groups step on flat element shards beside the owners' whole Muon matrices: LowLevelZero's
    ZeRO 1/2 over more than one rank (low_level_zero, hybrid, moe_hybrid); Gemini and tp at ZeRO 0 step them whole."""
    return c.plugin in ("low_level_zero", "hybrid", "moe_hybrid") and c.stage >= 1 and c.dp * c.sp > 1


def fsdp_rows(c: Candidate) -> bool:
    """TorchFSDPPlugin over dp > 1 (`cx_plugins.fsdp.ShardedMuon`): every state on the rank's row shards, Newton-Schulz
    on each whole Muon matrix at its owner, gathered and scattered back in bf16."""
    return c.plugin == "torch_fsdp" and c.dp > 1


def tp_zero_owners(c: Candidate) -> bool:
    """HybridParallelPlugin at ZeRO 1/2 with tp > 1 (`cx_plugins.hybrid.ZeroTensorParallelWhole`): ZeRO gathers each
    Muon matrix's tp slice whole to a dp owner, whose tp group gathers the slices to a tp owner holding the whole fp32
    master and momentum; the AdamW groups step on ZeRO's flat shards. MoeHybridParallelPlugin runs the same step
    (experts owned over moe_dp) but is not modelled so yet: it counts as ZeRO's dp owners of whole matrices."""
    return c.plugin == "hybrid" and c.tp > 1 and c.stage >= 1 and c.dp * c.sp > 1


@functools.lru_cache(maxsize=64)
def two_level_loads(split: MuonSplit, dp: int, tp: int) -> tuple[int, OwnerLoad]:
    """Under `tp_zero_owners`: the busiest dp owner's Muon elements (whole shapes; it holds 1/tp of them, its tp
    slices) and the busiest tp owner's load among the matrices owned at that dp coordinate."""
    muon = [i for i, m in enumerate(split.muon) if m]
    dp_owners = assign_owners([split.shapes[i] for i in muon], dp)
    best: tuple[int, OwnerLoad] = (0, _load(split, []))
    for r in range(dp):
        owned = [i for i, o in zip(muon, dp_owners, strict=True) if o == r]
        tp_owners = assign_owners([split.shapes[i] for i in owned], tp) if owned else []
        loads = [_load(split, [i for i, o in zip(owned, tp_owners, strict=True) if o == t]) for t in range(tp)]
        load = max(loads, key=lambda x: (x.state_bytes + 8 * x.elements, x.ns_flops))
        elements = sum(_numel(split.shapes[i]) for i in owned)
        if (elements, load.elements) > (best[0], best[1].elements):
            best = (elements, load)
    return best


def rank_load(c: Candidate, split: MuonSplit) -> OwnerLoad:
    """What the busiest rank of `c`'s whole-parameter group steps over the whole model: its owner share of the
    whole parameters and, where `adamw_on_shards`, its flat shard of every AdamW parameter. Under `fsdp_rows`: 1/dp
    of every state and element (no whole master), the busiest owner's Newton-Schulz."""
    group = whole_group(c)
    if tp_zero_owners(c):  # the busiest tp owner's whole matrices, and a flat shard of every AdamW slice
        _, owned = two_level_loads(split, group, c.tp)
        shard = -(-split.adamw_shard_elements(group) // c.tp)
        return replace(owned, state_bytes=owned.state_bytes + ADAMW_STATE_BYTES * shard, sharded_elements=shard)
    if fsdp_rows(c):
        owner = busiest_owner(split, group, muon_only=True)
        return OwnerLoad(
            0, split.state_bytes // group, -(-split.muon_elements // group), owner.largest_matrix, owner.ns_flops,
            -(-split.total // group),
        )  # fmt: skip
    if not adamw_on_shards(c):
        return busiest_owner(split, group)
    load = busiest_owner(split, group, muon_only=True)
    shard = split.adamw_shard_elements(group)
    return replace(load, state_bytes=load.state_bytes + ADAMW_STATE_BYTES * shard, sharded_elements=shard)


@functools.lru_cache(maxsize=8)
def muon_split(shape: ModelShape) -> MuonSplit:
    """The model `shape` builds (on the meta device), grouped as cx-train groups it for MuonWithAdamW."""
    with torch.device("meta"):
        model = build_model(shape)
    use_muon = {id(p): bool(group["use_muon"]) for group in muon_param_groups(model) for p in group["params"]}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in use_muon]
    routed = bool(shape.num_experts)
    return MuonSplit(
        tuple(tuple(p.shape) for _, p in named),
        tuple(use_muon[id(p)] for _, p in named),
        tuple(routed and is_routed_expert(n) for n, _ in named),
    )


def experts_stepped_locally(c: Candidate) -> bool:
    """MoeHybridParallelPlugin at tp > 1 and ZeRO 0: the routed experts are replicated over tp, so each tp rank
    steps its own whole stacks (no owner, no gather); `_tp_whole` gives only the tp-split parameters owners."""
    return c.plugin == "moe_hybrid" and c.tp > 1 and c.stage == 0


def muon_on_host(c: Candidate) -> bool:
    """Whether the owners' whole fp32 masters, the gradients gathered to them and so Newton-Schulz live on the CPU:
    cx-zero's cpu_offload (hybrid / moe_hybrid ZeRO 1/2 at tp > 1 among them), or Gemini with its optimizer data
    on the CPU (`offload_optim_frac > 0` or `auto` placement: `cx_zero.GeminiWholeStep` keeps the wholes there)."""
    if not c.muon:
        return False
    gemini_cpu = c.plugin == "gemini" and (c.offload_optim_frac > 0 or c.placement_policy == "auto")
    return c.cpu_offload or gemini_cpu


def whole_group(c: Candidate) -> int:
    """The ranks among which cx assigns whole parameters owners (1: every rank steps every parameter it holds):
    the gradient group (dp x sp) under ZeRO 1/2, Gemini's dp, the tp group at hybrid ZeRO 0 (`_tp_whole`)."""
    if adamw_on_shards(c):
        return c.dp * c.sp
    if fsdp_rows(c):
        return c.dp
    if c.plugin == "gemini" and c.dp > 1:
        return c.dp
    if c.plugin in ("hybrid", "moe_hybrid") and c.tp > 1:
        return c.tp
    return 1


def _scaled(load: OwnerLoad, scale: float) -> OwnerLoad:
    return OwnerLoad(
        int(load.elements * scale), int(load.state_bytes * scale), int(load.muon_elements * scale),
        load.largest_matrix, int(load.ns_flops * scale), int(load.sharded_elements * scale),
    )  # fmt: skip


def _share(load: OwnerLoad, elements: float, split: MuonSplit) -> OwnerLoad:
    """`load` scaled to a stage holding `elements` of `split`'s whole elements."""
    return _scaled(load, elements / split.total if split.total else 0.0)


def stepped_load(c: Candidate, shape: ModelShape) -> OwnerLoad:
    """What the busiest rank steps under `c` (a pipeline stage's share of the busiest rank's load, `rank_load`, in
    proportion to the stage's whole elements: the layers split over pp, routed experts over ep). Where the experts
    are stepped locally (`experts_stepped_locally`): the busiest tp owner's share of the other parameters plus all
    of the rank's experts."""
    split = muon_split(shape)
    counts = shape.parameters
    if experts_stepped_locally(c):
        dense, experts = split.part(expert=False), split.part(expert=True)
        owned = _share(busiest_owner(dense, c.tp), counts.dense / c.pp, dense)
        local = _share(busiest_owner(experts, 1), counts.experts / (c.ep * c.pp), experts)
        largest = max(owned.largest_matrix, local.largest_matrix, key=lambda mn: mn[0] * mn[1])
        return OwnerLoad(
            owned.elements + local.elements, owned.state_bytes + local.state_bytes,
            owned.muon_elements + local.muon_elements, largest, owned.ns_flops + local.ns_flops,
        )  # fmt: skip
    stage = (counts.dense + counts.experts / c.ep) / c.pp
    return _share(rank_load(c, split), stage, split)
