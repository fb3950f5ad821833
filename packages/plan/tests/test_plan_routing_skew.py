"""Routing skew (`--routing-skew S`): the trace routes ep rank 0's experts S times their balanced share, so the
predicted expert activations and the expert compute and all-to-all are the hottest rank's.

References: the skewed choice's counts against the docstring's construction; the trace's extra saved bytes against
cx-moe's own `expert_mlp` run for real in this process on the extra rows (what autograd saves); the step time's extra
FLOPs and all-to-all bytes against the closed form (6 x routed parameters per token, top_k copies per token).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from cx_moe import expert_mlp
from cx_plan import Candidate, load_model_shape
from cx_plan._cli import main
from cx_plan._devices import Device, lookup_device
from cx_plan._enumerate import SearchSpace, enumerate_candidates
from cx_plan._planner import MemoryModel
from cx_plan._report import MemoryVerdict
from cx_plan.step_time._comm_volume import step_collectives
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace._activations import ActivationTrace, trace_stage
from cx_plan.trace._model_spec import ModelShape, ParameterCounts
from cx_plan.trace._oracle import Routing, _skewed_choice, hot_rank_load
from cx_plan.trace._trace_cache import trace_key

HIDDEN, LAYERS, SEQ = 64, 2, 32
_EXPERT_ALL_TO_ALL = "expert dispatch/combine all-to-all"


@pytest.fixture(scope="module")
def mixtral() -> ModelShape:
    return load_model_shape("mixtral", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)


def _moe_shape() -> ModelShape:
    """A Mixtral-like shape written out: 4 layers, 8 experts of 3 x 64 x 128, top-2 (test_plan_step_time's)."""
    per_expert = 3 * 64 * 128
    counts = ParameterCounts(
        total=4 * (20_000 + 8 * per_expert) + 2 * 64 * 1000, outer=2 * 64 * 1000, embeddings=2 * 64 * 1000,
        dense_per_layer=(20_000,) * 4, experts_per_layer=(8 * per_expert,) * 4, per_expert=per_expert, tied=False,
    )  # fmt: skip
    return ModelShape("moe", "mixtral", 1000, 64, 4, 4, 2, 16, 128, 8, 2, 64, counts, None)


def test_skewed_choice_gives_the_hot_rank_its_share_with_distinct_experts_per_token() -> None:
    # 32 tokens x top-2 over 8 experts, ep 4 (2 experts a rank), load 1.5: q = 1.5 x 2 / 4 = 3/4 hot slots a token,
    # floor(32 x 3/4) = 24 hot slots, 12 each for experts 0 and 1 = 1.5 x the mean (64 / 8 = 8); 40 cold slots over 6
    choice = _skewed_choice(32, 2, Routing(1.5, 8, 4))
    counts = torch.bincount(choice.reshape(-1), minlength=8).tolist()
    assert counts[:2] == [12, 12]
    assert sorted(counts[2:]) == [6, 6, 7, 7, 7, 7]
    assert all(row[0] != row[1] for row in choice.tolist())
    # load 2 with ep 2 over 4 experts: every slot on rank 0's experts, still two distinct experts a token
    full = _skewed_choice(32, 2, Routing(2.0, 4, 2))
    assert torch.bincount(full.reshape(-1), minlength=4).tolist() == [32, 32, 0, 0]
    assert all(row == [0, 1] for row in full.tolist())


def test_hot_rank_load_is_capped_by_what_routing_allows() -> None:
    assert hot_rank_load(1.5, 4, 8, 2) == 1.5
    assert hot_rank_load(3.0, 2, 8, 2) == 2.0  # rank 0 holds half the experts: at most every assignment
    assert hot_rank_load(8.0, 8, 8, 2) == 4.0  # an expert takes at most one of a token's 2 slots: E / k
    assert hot_rank_load(4.0, 1, 8, 2) == 1.0  # without ep every rank holds every expert
    with pytest.raises(ValueError, match="routing_skew must be >= 1"):
        hot_rank_load(0.5, 2, 8, 2)


def _saved_by_expert_mlp(rows: int, shape: ModelShape, local: int) -> int:
    """Bytes autograd saves running cx-moe's expert MLP for real on `rows` rows (the rows included), fp32."""
    hidden, inner = shape.hidden_size, shape.intermediate_size
    x = torch.randn(rows, hidden, requires_grad=True)
    gate_up = torch.randn(local, 2 * inner, hidden, requires_grad=True)
    down = torch.randn(local, hidden, inner, requires_grad=True)
    weights = {gate_up.untyped_storage().data_ptr(), down.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        expert_mlp(x, [rows // local] * local, gate_up, down, torch.nn.functional.silu, gated=True)
    return sum(seen.values())


def test_skew_two_doubles_the_hot_ranks_expert_activations_and_flops(mixtral: ModelShape) -> None:
    # moe_hybrid dp 2 ep 2, 4 experts top-2: balanced, ep rank 0 computes T x k = 32 x 2 = 64 rows a layer; at skew 2
    # (hot_rank_load 2) all 128 rows of the group, so the expert part of every figure doubles
    balanced = Candidate("moe_hybrid", dp=2, ep=2, precision="fp32")
    skewed = dataclasses.replace(balanced, routing_skew=2.0)
    one, two = trace_stage(mixtral, balanced, SEQ), trace_stage(mixtral, skewed, SEQ)
    rows = SEQ * mixtral.top_k
    local = mixtral.num_experts // 2
    # forward FLOPs: the grouped matmuls' 2 x rows x H x 2I (gate_up) + 2 x rows x I x H (down), once more
    extra_flops = LAYERS * 6 * rows * mixtral.hidden_size * mixtral.intermediate_size
    assert two.forward_flops - one.forward_flops == extra_flops
    # saved activations: the MLP's own for 64 more rows a layer (the reference), plus dispatch / combine's per-row
    # bookkeeping, at most two int64 indices a row (the regroup permutation and its inverse)
    reference = _saved_by_expert_mlp(2 * rows, mixtral, local) - _saved_by_expert_mlp(rows, mixtral, local)
    extra_saved = two.saved_bytes - one.saved_bytes
    assert 0 <= extra_saved - LAYERS * reference <= LAYERS * rows * 2 * 8, (extra_saved, reference)
    assert two.activation_bytes - one.activation_bytes >= extra_saved  # the peak holds them too
    # the same facts otherwise: parameters and the op sequence do not depend on the routing
    assert (two.parameter_bytes, two.forward_ops, two.backward_ops) == (one.parameter_bytes, one.forward_ops,
                                                                        one.backward_ops)  # fmt: skip


def test_skew_leaves_dense_candidates_and_skew_one_as_they_were(mixtral: ModelShape) -> None:
    hybrid = Candidate("hybrid", dp=2, precision="fp32")
    assert trace_stage(mixtral, dataclasses.replace(hybrid, routing_skew=2.0), SEQ) == trace_stage(mixtral, hybrid, SEQ)
    ep1 = Candidate("moe_hybrid", dp=2, precision="fp32")  # every rank holds every expert: no hot rank
    assert trace_stage(mixtral, dataclasses.replace(ep1, routing_skew=2.0), SEQ) == trace_stage(mixtral, ep1, SEQ)
    ep2 = Candidate("moe_hybrid", dp=2, ep=2, precision="fp32")
    explicit = trace_stage(mixtral, dataclasses.replace(ep2, routing_skew=1.0), SEQ)
    assert isinstance(explicit, ActivationTrace)
    assert explicit == trace_stage(mixtral, ep2, SEQ)
    # the cache key: a skewed MoeHybrid trace is its own, a dense one is shared
    assert trace_key(dataclasses.replace(ep2, routing_skew=2.0), 0) != trace_key(ep2, 0)
    assert trace_key(dataclasses.replace(hybrid, routing_skew=2.0), 0) == trace_key(hybrid, 0)


def test_step_time_charges_the_hot_ranks_experts_and_all_to_all() -> None:
    shape, device = _moe_shape(), lookup_device("h100")
    c = Candidate("moe_hybrid", dp=4, ep=4, micro_batch_size=2, precision="bf16")
    hot = dataclasses.replace(c, routing_skew=1.5)
    base, skewed = predict_step_time(c, shape, 64, device), predict_step_time(hot, shape, 64, device)
    # compute: 6 x the routed parameters a token passes (top_k / E of them) x 0.5 more, per rank's share of tokens
    routed = 6 * shape.parameters.experts * shape.top_k / shape.num_experts
    rate = device.peak("bf16") * 0.45
    extra = c.global_batch_size * 64 * routed * 0.5 / c.world_size / rate
    assert skewed.compute_s - base.compute_s == pytest.approx(extra, rel=1e-12)
    moved = {col.name: col.bytes for col in step_collectives(c, shape, 64)}
    moved_hot = {col.name: col.bytes for col in step_collectives(hot, shape, 64)}
    assert moved_hot[_EXPERT_ALL_TO_ALL] == pytest.approx(1.5 * moved[_EXPERT_ALL_TO_ALL], rel=1e-12)
    assert {k: v for k, v in moved_hot.items() if k != _EXPERT_ALL_TO_ALL} == {
        k: v for k, v in moved.items() if k != _EXPERT_ALL_TO_ALL
    }
    assert skewed.step_s > base.step_s
    assert skewed.flops_per_token == base.flops_per_token  # model FLOPs: MFU falls with the skew
    for dense in (Candidate("torch_ddp", dp=4), Candidate("hybrid", dp=2, tp=2), Candidate("moe_hybrid", dp=4)):
        assert predict_step_time(dataclasses.replace(dense, routing_skew=2.0), shape, 64, device) == (
            predict_step_time(dense, shape, 64, device)
        )


def test_routing_skew_is_validated_and_reaches_the_candidates_and_report(
    mixtral: ModelShape, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="routing_skew must be a number >= 1"):
        Candidate("moe_hybrid", dp=2, ep=2, routing_skew=0.9)
    with pytest.raises(ValueError, match="routing_skew must be >= 1"):
        enumerate_candidates(mixtral, 2, SEQ, SearchSpace(routing_skew=0.5))
    found = enumerate_candidates(mixtral, 2, SEQ, SearchSpace(plugins=("hybrid", "moe_hybrid"), routing_skew=1.5))
    assert {c.routing_skew for c in found if c.plugin == "moe_hybrid"} == {1.5}
    assert {c.routing_skew for c in found if c.plugin == "hybrid"} == {1.0}
    flags = ["--model", "mixtral", "--hidden-size", "64", "--num-layers", "2", "--seq-len", "32", "--world", "2",
             "--device", "cpu", "--plugins", "moe_hybrid", "--quiet"]  # fmt: skip
    assert main([*flags, "--routing-skew", "0.5"], memory_factory=_stub) == 2
    assert "--routing-skew must be >= 1" in capsys.readouterr().err
    assert main([*flags, "--routing-skew", "1.5"], memory_factory=_stub) == 0
    assert "routing skew 1.5: the worst rank's memory and time" in capsys.readouterr().out
    assert main([*flags, "--routing-skew", "1.5", "--json"], memory_factory=_stub) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["routing_skew"] == 1.5
    assert {row["candidate"]["routing_skew"] for row in plan["rows"]} == {1.5}
    assert main(flags, memory_factory=_stub) == 0
    assert "routing skew" not in capsys.readouterr().out  # balanced: the header as before


@dataclasses.dataclass(frozen=True)
class _Verdict:
    fits: bool = True
    peak_bytes: int = 1
    reason: str = ""


def _stub(shape: ModelShape, seq_len: int, device: Device) -> MemoryModel:
    """Every candidate fits (the command's tests stub the memory model; the traces are tested above)."""

    def verdict(candidate: Candidate) -> MemoryVerdict:
        return _Verdict()

    return verdict
