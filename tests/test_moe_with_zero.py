"""cx-moe's parameter marking plugs into cx-zero's LowLevelZeroOptimizer through `pg_to_param_list` alone: an
expert-parallel model (ep 2 x moe-dp 2 on 4 ranks) trained with ZeRO-1 and ZeRO-2 matches single-process training
(each rank its own batch; the reference loss is the mean over ranks) over several steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import distributed
from cx_moe import ExpertOptions, MoeLayer, RouterOptions, collect_router_losses, get_moe_info, moe_param_groups
from cx_zero import LowLevelZeroOptimizer

STEPS = 3


class _Model(nn.Module):
    def __init__(self, ep_group: dist.ProcessGroup | None = None, moe_dp: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.moe = MoeLayer(
            ExpertOptions(16, 8, shared_intermediate_size=8),
            RouterOptions(4, 2, aux_loss_coef=0.01),
            ep_group=ep_group,
            moe_dp_group=moe_dp,
        )
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        out: torch.Tensor = self.out(h + self.moe(h))
        return out


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(5 + rank, 16, generator=g), torch.randn(5 + rank, 4, generator=g)


def _loss(model: _Model, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    task: torch.Tensor = ((model(x) - y) ** 2).mean()
    return task + collect_router_losses(model)


@distributed(world_size=4)
@pytest.mark.parametrize("partition_grad", [False, True])
def test_expert_parallel_model_trains_under_low_level_zero(rank: int, world_size: int, partition_grad: bool) -> None:
    mesh = ProcessGroupMesh(2, 2, axis_names=("moe_dp", "ep"))
    ep_group, moe_dp = mesh.get_group_along_axis("ep"), mesh.get_group_along_axis("moe_dp")
    torch.manual_seed(0)
    model = _Model(ep_group, moe_dp)
    torch.manual_seed(0)
    reference = _Model()
    groups = moe_param_groups(model)
    assert len(groups) == 2
    assert groups[moe_dp] == [model.moe.experts.gate_up_proj, model.moe.experts.down_proj]
    optimizer = LowLevelZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.2), pg_to_param_list=groups, partition_grad=partition_grad
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.2)
    for step in range(STEPS):
        ref_optimizer.zero_grad()
        ref_losses = [_loss(reference, r, step) for r in range(world_size)]
        (sum(ref_losses) / world_size).backward()  # type: ignore[union-attr]
        ref_optimizer.step()
        optimizer.zero_grad()
        loss = _loss(model, rank, step)
        optimizer.backward(loss)
        optimizer.step()
        torch.testing.assert_close(loss.detach(), ref_losses[rank].detach(), rtol=1e-5, atol=1e-6)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        info = get_moe_info(p)
        want = ref[name].detach()
        if info is not None:
            want = want[info.local_experts.start : info.local_experts.stop]
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6, msg=name)
