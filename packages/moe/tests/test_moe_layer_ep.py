"""The expert-parallel MoeLayer at ep 1, 2 and 4 against the same layer unsplit on one process: outputs, losses,
parameters and every gradient over several SGD steps (fp32, 1e-5), under balanced and forced-skew routing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_moe import CapacityOptions, ExpertOptions, MoeLayer, RouterOptions, collect_router_losses, is_moe_tensor
from moe_test_helpers import (
    FP32,
    HIDDEN,
    INTER,
    compare_to_reference,
    force_routing,
    groups,
    probe_loss,
    rank_batch,
    reduce_like_data_parallel,
)

STEPS = 3
LR = 0.1


def _build(ep_size: int, case: str) -> tuple[MoeLayer, MoeLayer, int]:
    """(ep layer, unsplit reference, ep rank) from one seed; `case` picks the routing."""
    shared = 8 if case == "shared" else 0
    experts = ExpertOptions(HIDDEN, INTER, shared_intermediate_size=shared, shared_expert_gate=bool(shared))
    router = RouterOptions(num_experts=8, top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001)
    capacity = None
    if case == "capacity_dropping":
        capacity = CapacityOptions(0.5, drop_policy="probability")
    elif case == "capacity_padded":
        capacity = CapacityOptions(0.75, drop_policy="position", pad_to_capacity=True)
    ep_group, moe_dp_group = groups(ep_size)
    torch.manual_seed(0)
    layer = MoeLayer(experts, router, capacity=capacity, ep_group=ep_group, moe_dp_group=moe_dp_group)
    torch.manual_seed(0)
    reference = MoeLayer(experts, router, capacity=capacity)
    for model in (layer, reference):
        if case == "one_hot_expert":
            force_routing(model.gate.weight, hot=5)
        elif case == "unused_experts":
            force_routing(model.gate.weight, unused=(0, 3, 6))
    return layer, reference, dist.get_rank(ep_group)


def _tokens(rank: int, case: str) -> int:
    if case == "empty_rank" and rank == 1:
        return 0
    if case == "capacity_padded":
        return 8  # padded capacity needs the same token count on every rank
    return 6 + 3 * rank  # uneven batches


def _inputs(rank: int, case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, probe = rank_batch(rank, _tokens(rank, case), step)
    if case in ("one_hot_expert", "unused_experts"):
        x = x.abs() + 0.1  # positive inputs: force_routing decides
    return x, probe


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("ep_size", [1, 2, 4])
@pytest.mark.parametrize(
    "case",
    ["balanced", "shared", "one_hot_expert", "unused_experts", "empty_rank", "capacity_dropping", "capacity_padded"],
)
def test_moe_layer_matches_unsplit_layer(rank: int, world_size: int, ep_size: int, case: str) -> None:
    if ep_size > world_size or (case == "empty_rank" and world_size == 1):
        pytest.skip("needs more ranks")
    layer, reference, ep_rank = _build(ep_size, case)
    for step in range(STEPS):
        # the reference sees every rank's batch; its loss is the mean of the per-rank losses (data parallelism)
        ref_total = torch.zeros(())
        for r in range(world_size):
            x, probe = _inputs(r, case, step)
            out = reference(x)
            ref_loss = probe_loss(out, probe) + collect_router_losses(reference)
            ref_total = ref_total + ref_loss / world_size
            if r == rank:
                ref_out, ref_rank_loss = out.detach(), ref_loss.detach()
        ref_total.backward()

        x, probe = _inputs(rank, case, step)
        chosen = reference.gate(x).indices
        reference.gate.aux_loss = reference.gate.z_loss = None
        if case == "one_hot_expert":
            assert (chosen[:, 0] == 5).all(), "forced routing: every token's first choice is expert 5"
        if case == "unused_experts":
            assert not torch.isin(chosen, torch.tensor([0, 3, 6])).any(), "forced routing: experts 0, 3, 6 unused"
        out = layer(x)
        loss = probe_loss(out, probe) + collect_router_losses(layer)
        loss.backward()
        torch.testing.assert_close(out, ref_out, **FP32, msg=f"step {step}: output")
        torch.testing.assert_close(loss.detach(), ref_rank_loss, **FP32, msg=f"step {step}: loss")

        reduce_like_data_parallel(layer)
        compare_to_reference(layer, reference, ep_rank, ep_size, f"step {step}")
        for model in (layer, reference):
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(LR * p.grad)
                        p.grad = None
    compare_to_reference(layer, reference, ep_rank, ep_size, "after the steps")


@distributed(world_size=2)
def test_moe_layer_holds_one_slice_per_rank_and_marks_it(rank: int, world_size: int) -> None:
    layer, reference, _ep_rank = _build(2, "balanced")
    assert layer.experts.gate_up_proj.shape == (4, 2 * INTER, HIDDEN)
    assert layer.experts.down_proj.shape == (4, HIDDEN, INTER)
    expert_numel = sum(p.numel() for p in layer.parameters() if is_moe_tensor(p))
    full_numel = reference.experts.gate_up_proj.numel() + reference.experts.down_proj.numel()
    assert expert_numel * 2 == full_numel
    assert {n for n, p in layer.named_parameters() if is_moe_tensor(p)} == {
        "experts.gate_up_proj",
        "experts.down_proj",
    }
    assert list(layer.state_dict()) == list(reference.state_dict())
