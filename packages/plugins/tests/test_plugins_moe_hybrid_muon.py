"""MoeHybridParallelPlugin (ep 2, tp 1; also moe_dp 2, pp 2 and sp 2; tp 2 at every zero_stage with ep 1 and ep 2, and
with pp 2 or sequence parallelism) with matrix-wise optimizers, against the same optimizer on one process.

Expert parallelism splits each fused expert stack ((experts, out, in)) along the expert dimension, so every ep rank
holds whole experts, and dense matrices are replicated over dp (tp 1): at zero_stage 0 each rank steps whole
matrices as they are; at zero_stage 1 LowLevelZero steps each parameter whole on an owner rank of its group (dense
over dp = moe_dp x ep, experts over moe_dp; `cx_zero._whole_step`). cx-zero's MuonWithAdamW over
`muon_param_groups` orthogonalises each expert's matrix on its own (`cx_zero._muon_stacks`); torch's Muon takes
2-D matrices only, so with it the expert stacks and the norms are frozen on both sides. Bounds as in
test_plugins_hybrid_muon.py (Muon: 0.2 of one effective step lr * sqrt(max(1, rows / cols)) of one matrix, derived
in packages/zero/tests/test_zero_low_level_muon.py; the ep dispatch and the dp average change the fp32 gradients by
rounding only) and test_plugins_hybrid_muon_adamw.py (AdamW: 0.2 of lr per step taken). Measured worst at world 2:
0.36x the bound (o_proj), the expert stacks 0.27x; torch's Muon (experts frozen) matches bit for bit. A checkpoint
(the momentum of each expert stack gathered over ep) resumes bit-exactly.
tp 2 at zero_stage 0: every tp-split tensor is gathered whole to an owner rank of the tp group and stepped there
(the base plugin's `_tp_whole`); the experts are replicated over tp by default (each tp rank steps its whole stacks
identically), or split along each expert's intermediate dimension with `expert_tensor_parallel=True`, whose slices
`_tp_whole` gathers into whole stacks, so each expert is still orthogonalised whole. Without `_tp_whole` (Newton-
Schulz per slice) q_proj is off by 5.4x the bound; with it the replicated-expert runs match bit for bit and the
expert-tp ones reach 0.36x (tp 2 x ep 2, o_proj), the tp-split stacks 0.27x. Their checkpoints (each rank's slice of
the owners' momentum) resume bit-exactly.
tp 2 at zero_stage 1/2 (tp 2 x moe_dp 2 with ep 1, tp 2 x ep 2): ZeRO gathers each tp slice whole onto its owner in
the slice's group (dense over dp, experts over moe_dp), whose tp group gathers the slices to a tp owner
(`_tp_zero_whole`), under the same bounds: torch's Muon matches bit for bit, MuonWithAdamW reaches 0.36x (o_proj),
the tp-split stacks 0.27x; checkpoints resume bit-exactly. Without the tp step (each ZeRO owner orthogonalising its
tp slice) all four cases fail (q_proj, or the embedding the changed loss moves). The same at tp 2 x pp 2 (ZeRO-1,
dp 1: each stage's tp group gathers its own slices) and at ZeRO-2 with sequence parallelism (split_gather over tp 2 x
moe_dp 2, all_to_all over tp 2 x sp 2, where ZeRO's dense group is sp): without the tp step each fails (q_proj of the
second stage, or the embedding). bf16 working weights (fp32 masters; ZeRO-1 over tp 2 x moe_dp 2, torch's Muon) are
held to one process's emulated mixed-precision step under the bf16 bound of muon_test_helpers (0.5 of an effective
step, derived on the one-layer Llama); without the tp step q_proj fails it. With cpu_offload (ZeRO-2, experts split over
tp) the same bounds hold: the masters stay on the CPU, the tp collectives run on the communication device (the CPU
here too: gloo runs no device copies, so only a GPU run checks those moves).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import distributed
from cx_moe import get_moe_info
from cx_plugins import Booster, HybridParallelModule, MoeHybridParallelPlugin, OptimizerWrapper
from cx_plugins._layout import Axis
from cx_shardformer import get_shard_spec, unshard_tensor
from cx_shardformer.policies import MixtralForCausalLMPolicy
from moe_hybrid_test_helpers import ROWS, mixtral, rows
from muon_test_helpers import (
    ADAMW_BOUND,
    BF16_FLIP_BOUND,
    MUON_LR,
    STEPS,
    assert_close_bf16,
    bf16_reference_step,
    freeze_all_but_matrices,
    muon_adamw,
    muon_bound,
    reference_step,
    save_and_load_fresh,
    torch_muon,
)


def _model(kind: str, layers: int = 1) -> nn.Module:
    model = mixtral(layers=layers)
    # torch's Muon: 2-D matrices only
    return freeze_all_but_matrices(model) if kind == "muon" else model


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    return torch_muon(model) if kind == "muon" else muon_adamw(model)


def _mine(plugin: MoeHybridParallelPlugin, step: int) -> torch.Tensor:
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = ROWS // dp_size
    return rows(step)[dp_rank * share : (dp_rank + 1) * share]


def _reference_step(
    reference: nn.Module, optimizer: torch.optim.Optimizer, step: int, dp_size: int, precision: str
) -> None:
    """The mean over dp ranks of each rank's own loss (the aux loss is per forward); bf16: its mixed-precision
    emulation."""
    share = ROWS // dp_size
    pieces = [rows(step)[r * share : (r + 1) * share] for r in range(dp_size)]
    if precision == "bf16":
        bf16_reference_step(reference, optimizer, [{"input_ids": p, "labels": p} for p in pieces])
        return
    reference_step(torch.stack([reference(input_ids=p, labels=p).loss for p in pieces]).mean(), optimizer)


def _whole(plugin: MoeHybridParallelPlugin, param: torch.Tensor) -> torch.Tensor:
    """A tp slice gathered over tp along its spec, then an expert slice over ep along the expert dimension."""
    full = param.detach()
    spec = get_shard_spec(param)
    if spec is not None:
        full = unshard_tensor(full, spec, plugin.tp_group)
    if get_moe_info(param) is None:
        return full
    parts = [torch.empty_like(full) for _ in range(plugin.ep_size)]
    dist.all_gather(parts, full.contiguous(), group=plugin.ep_group)
    return torch.cat(parts, dim=0)


def _train_step(
    booster: Booster,
    plugin: MoeHybridParallelPlugin,
    model: HybridParallelModule,
    optimizer: OptimizerWrapper,
    step: int,
) -> None:
    """One step on this dp rank's rows: one micro-batch through the pipeline (pp > 1), or forward and backward."""
    mine = _mine(plugin, step)
    if plugin.pp_size > 1:
        batch = iter([{"input_ids": mine, "labels": mine}])
        booster.execute_pipeline(batch, model, lambda outputs, _: outputs.loss, optimizer, return_loss=True)
    else:
        booster.backward(model(input_ids=mine, labels=mine).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def _train_compare_resume(
    kind: str,
    zero_stage: int,
    tmp_path: Path,
    pp: int = 1,
    sp: int = 1,
    tp: int = 1,
    ep: int = 2,
    expert_tp: bool = False,
    sp_mode: str = "all_to_all",
    precision: str = "fp32",
    cpu_offload: bool = False,
) -> None:
    """Train STEPS steps beside one process, compare every parameter this rank holds, then save, load into a fresh
    pair and check that one more step agrees bit for bit. `expert_tp`: the experts split over tp as well; `sp_mode`
    with sp > 1 (split_gather runs on the tp group: sp stays 1 in the layout); bf16 (torch's Muon only: no AdamW bound
    derived for it) against one process's emulation of the mixed-precision step, both sides rounded to bf16."""
    model = _model(kind, layers=pp)
    reference = copy.deepcopy(model)
    plugin = MoeHybridParallelPlugin(
        tp_size=tp,
        pp_size=pp,
        ep_size=ep,
        precision=precision,
        zero_stage=zero_stage,
        cpu_offload=cpu_offload,
        num_microbatches=1 if pp > 1 else None,
        sp_size=sp if sp > 1 and sp_mode == "all_to_all" else None,
        enable_sequence_parallelism=sp > 1,
        sequence_parallelism_mode=sp_mode if sp > 1 else None,
        custom_policy=MixtralForCausalLMPolicy(expert_tensor_parallel=True) if expert_tp else None,
    )
    sizes = (Axis.PP, Axis.SP, Axis.TP, Axis.EP)
    assert tuple(plugin.layout.size(a) for a in sizes) == (pp, sp if sp_mode == "all_to_all" else 1, tp, ep)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, _optimizer(kind, model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = _optimizer(kind, reference)
    _, dp_size = plugin.data_parallel_rank_and_size()
    for step in range(STEPS):
        _train_step(booster, plugin, boosted, optimizer, step)
        _reference_step(reference, reference_optimizer, step, dp_size, precision)
    muon = {id(p) for g in reference_optimizer.param_groups if g.get("use_muon", True) for p in g["params"]}
    expected = dict(reference.named_parameters())
    stacks, tp_stacks, tp_split = 0, 0, 0
    held = boosted.held_parameter_names()
    for name, param in boosted.unwrap().named_parameters():
        if name not in held:
            continue
        full, want = _whole(plugin, param), expected[name]
        stack = ".experts." in name and full.ndim == 3 and id(want) in muon
        stacks += stack and (get_moe_info(param) is not None) == (ep > 1)
        tp_stacks += stack and get_shard_spec(param) is not None
        tp_split += get_shard_spec(param) is not None and id(want) in muon
        if precision == "bf16":
            assert kind == "muon", kind
            bound = muon_bound(MUON_LR, *full.shape[-2:], flip=BF16_FLIP_BOUND) if id(want) in muon else 0.0
            assert_close_bf16(full, want, bound, name)
            continue
        bound = muon_bound(MUON_LR, *full.shape[-2:]) if id(want) in muon else ADAMW_BOUND
        torch.testing.assert_close(full, want.detach(), rtol=0, atol=bound, msg=name)
    # gate_up_proj and down_proj stepped by Muon, split over ep when ep > 1 (and over tp with expert_tp)
    assert stacks == (2 if kind == "muon_adamw" else 0)
    assert tp_stacks == (2 if kind == "muon_adamw" and expert_tp else 0)
    assert tp_split >= (4 if tp > 1 else 0)  # q, k, v, o gathered whole over tp by `_tp_whole`
    # checkpoint: the momentum of every matrix (expert stacks gathered over ep); a fresh pair resumes bit-exactly
    resumed, resumed_optimizer = save_and_load_fresh(
        booster, boosted, optimizer, lambda: _model(kind, layers=pp), lambda m: _optimizer(kind, m), tmp_path
    )
    assert isinstance(resumed, HybridParallelModule)
    for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
        _train_step(booster, plugin, model_, optimizer_, STEPS)
    for (name, p), q in zip(boosted.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert name not in held or torch.equal(p, q), name


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("kind", "zero_stage"), [("muon_adamw", 0), ("muon_adamw", 1), ("muon_adamw", 2), ("muon", 0), ("muon", 1)]
)
def test_plugins_moe_hybrid_muon_matches_one_process(
    rank: int, world_size: int, kind: str, zero_stage: int, tmp_path: Path
) -> None:
    """ep 2 x moe_dp 1: dense matrices over dp 2 (ZeRO-1: two owners), expert stacks whole on their ep rank."""
    _train_compare_resume(kind, zero_stage, tmp_path)


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "expert_tp"), [("muon_adamw", False), ("muon_adamw", True), ("muon", False)])
def test_plugins_moe_hybrid_muon_tensor_parallel(
    rank: int, world_size: int, kind: str, expert_tp: bool, tmp_path: Path
) -> None:
    """tp 2 x ep 1, zero_stage 0: the tp-split dense matrices gathered whole to an owner over tp (`_tp_whole`); the
    expert stacks replicated over tp (stepped whole by both), or split over tp (`expert_tensor_parallel`, each
    expert's intermediate dimension) and gathered whole stacks to an owner like the dense slices."""
    _train_compare_resume(kind, 0, tmp_path, tp=2, ep=1, expert_tp=expert_tp)


@distributed(world_size=4)
@pytest.mark.parametrize("expert_tp", [False, True])
def test_plugins_moe_hybrid_muon_tensor_and_expert_parallel(
    rank: int, world_size: int, expert_tp: bool, tmp_path: Path
) -> None:
    """tp 2 x ep 2, zero_stage 0: each ep rank's two experts per stack, replicated or split over its tp group."""
    _train_compare_resume("muon_adamw", 0, tmp_path, tp=2, expert_tp=expert_tp)


@distributed(world_size=4)
@pytest.mark.parametrize(("pp", "sp", "expert_tp"), [(2, 1, True), (1, 2, False)])
def test_plugins_moe_hybrid_muon_tensor_parallel_with_pp_or_sp(
    rank: int, world_size: int, pp: int, sp: int, expert_tp: bool, tmp_path: Path
) -> None:
    """tp 2 x pp 2 (experts split over tp; each stage gathers its own slices) and tp 2 x sp 2 (all_to_all), zero_stage
    0, ep 1."""
    _train_compare_resume("muon_adamw", 0, tmp_path, pp=pp, sp=sp, tp=2, ep=1, expert_tp=expert_tp)


@distributed(world_size=4)
def test_plugins_moe_hybrid_muon_zero_over_moe_dp(rank: int, world_size: int, tmp_path: Path) -> None:
    """ep 2 x moe_dp 2 with ZeRO-1: each expert stack's flat shards over moe_dp gathered whole to one owner."""
    _train_compare_resume("muon_adamw", 1, tmp_path)


@distributed(world_size=4)
def test_plugins_moe_hybrid_muon_pipeline(rank: int, world_size: int, tmp_path: Path) -> None:
    """pp 2 x ep 2 (a layer per stage) with ZeRO-1: each stage steps its own whole matrices and expert stacks."""
    _train_compare_resume("muon_adamw", 1, tmp_path, pp=2)


@distributed(world_size=4)
def test_plugins_moe_hybrid_muon_sequence_parallel(rank: int, world_size: int, tmp_path: Path) -> None:
    """ep 2 x sp 2 (all_to_all) with ZeRO-1: dense gradients averaged over moe_dp x ep x sp, experts equal over sp."""
    _train_compare_resume("muon_adamw", 1, tmp_path, sp=2)


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("kind", "zero_stage", "ep", "expert_tp"),
    [("muon", 1, 1, False), ("muon_adamw", 2, 1, True), ("muon_adamw", 1, 2, True), ("muon", 2, 2, False)],
)
def test_plugins_moe_hybrid_muon_tensor_parallel_zero(
    rank: int, world_size: int, kind: str, zero_stage: int, ep: int, expert_tp: bool, tmp_path: Path
) -> None:
    """tp 2 with ZeRO-1/2 over tp 2 x moe_dp 2 (ep 1: one ZeRO group) or tp 2 x ep 2 (dense over ep, experts over a
    one-rank moe_dp): each ZeRO owner's tp slices gathered whole over tp (`_tp_zero_whole`)."""
    _train_compare_resume(kind, zero_stage, tmp_path, tp=2, ep=ep, expert_tp=expert_tp)


@distributed(world_size=4)
def test_plugins_moe_hybrid_muon_tensor_parallel_zero_pipeline(rank: int, world_size: int, tmp_path: Path) -> None:
    """tp 2 x pp 2 (ep 1, dp 1) with ZeRO-1, experts split over tp: each stage's tp group gathers its own slices
    (ZeRO's owner at dp 1 is every rank; the stages share no parameter)."""
    _train_compare_resume("muon_adamw", 1, tmp_path, pp=2, tp=2, ep=1, expert_tp=True)


@distributed(world_size=4)
@pytest.mark.parametrize("sp_mode", ["split_gather", "all_to_all"])
def test_plugins_moe_hybrid_muon_tensor_parallel_zero_sequence(
    rank: int, world_size: int, sp_mode: str, tmp_path: Path
) -> None:
    """ZeRO-2 at tp 2 (ep 1) with sequence parallelism: split_gather on the tp group over tp 2 x moe_dp 2 (the norms'
    sequence partial gradients summed over tp), all_to_all over tp 2 x sp 2 (ZeRO's dense group is sp); the tp slices
    gathered whole onto their ZeRO owner and from there over tp (`_tp_zero_whole`)."""
    _train_compare_resume("muon_adamw", 2, tmp_path, sp=2, tp=2, ep=1, sp_mode=sp_mode)


@distributed(world_size=4)
def test_plugins_moe_hybrid_muon_tensor_parallel_zero_bf16(rank: int, world_size: int, tmp_path: Path) -> None:
    """bf16 working weights, fp32 masters: ZeRO-1 over tp 2 x moe_dp 2 (ep 1), torch's Muon (experts frozen)."""
    _train_compare_resume("muon", 1, tmp_path, tp=2, ep=1, precision="bf16")


@distributed(world_size=4)
def test_plugins_moe_hybrid_muon_tensor_parallel_zero_cpu_offload(rank: int, world_size: int, tmp_path: Path) -> None:
    """ZeRO-2 with cpu_offload over tp 2 x moe_dp 2 (ep 1), experts split over tp: ZeRO's masters on the CPU, the tp
    collectives on the communication device (the CPU too under gloo: the moves themselves are not exercised)."""
    _train_compare_resume("muon_adamw", 2, tmp_path, tp=2, ep=1, expert_tp=True, cpu_offload=True)
