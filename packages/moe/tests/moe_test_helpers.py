"""Shared pieces of the cx-moe tests: per-test expert/moe-dp groups, per-rank data, forced routing, and the
data-parallel reduction every rank applies before comparing with the single-process reference."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroupMesh
from cx_mesh.testing import PerTestCache
from cx_moe import get_moe_dp_group, is_moe_tensor

_MESHES: PerTestCache[tuple[int, int], ProcessGroupMesh] = PerTestCache()
HIDDEN = 16
INTER = 8
FP32: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}


def groups(ep_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(ep_group, moe_dp_group) of a (moe_dp, ep) mesh over the world (shared by the calls of one test)."""
    world = dist.get_world_size()
    key = (world // ep_size, ep_size)
    if key not in _MESHES:
        _MESHES[key] = ProcessGroupMesh(*key, axis_names=("moe_dp", "ep"))
    mesh = _MESHES[key]
    return mesh.get_group_along_axis("ep"), mesh.get_group_along_axis("moe_dp")


def world() -> dist.ProcessGroup:
    return cast(dist.ProcessGroup, dist.group.WORLD)


def rank_batch(rank: int, tokens: int, step: int = 0, hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s input [tokens, hidden] and the probe its loss is taken against (same on every process)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(tokens, hidden, generator=g), torch.randn(tokens, hidden, generator=g)


def probe_loss(out: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """A per-rank loss with a fixed normaliser, so a rank with no tokens contributes exactly zero."""
    return (out * probe).sum() / 8.0


def force_routing(router_weight: torch.Tensor, hot: int | None = None, unused: tuple[int, ...] = ()) -> None:
    """Bias a router so that, on positive inputs, every token picks `hot` first and never picks `unused`."""
    with torch.no_grad():
        router_weight.mul_(0.01)
        if hot is not None:
            router_weight[hot] = 1.0
        for e in unused:
            router_weight[e] = -1.0


def reduce_like_data_parallel(model: nn.Module) -> None:
    """What ZeRO / DDP do to gradients: dense ones averaged over the world, expert ones over their moe-dp group."""
    for p in model.parameters():
        if p.grad is None:
            continue
        group = get_moe_dp_group(p) if is_moe_tensor(p) else world()
        dist.all_reduce(p.grad, group=group)
        p.grad /= dist.get_world_size(group)


def expert_slice(full: torch.Tensor, rank: int, ep_size: int) -> torch.Tensor:
    local = full.shape[0] // ep_size
    return full[rank * local : (rank + 1) * local]


def compare_to_reference(model: nn.Module, reference: nn.Module, ep_rank: int, ep_size: int, what: str) -> None:
    """Parameters and gradients of `model` (this rank's expert slices) against the unsplit `reference`."""
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        q = ref[name]
        if is_moe_tensor(p):
            q_value = expert_slice(q.detach(), ep_rank, ep_size)
            q_grad = None if q.grad is None else expert_slice(q.grad, ep_rank, ep_size)
        else:
            q_value, q_grad = q.detach(), q.grad
        torch.testing.assert_close(p.detach(), q_value, **FP32, msg=f"{what}: parameter {name}")
        if q_grad is None:
            assert p.grad is None or not p.grad.any(), f"{what}: {name} has a gradient the reference lacks"
        else:
            assert p.grad is not None, f"{what}: {name} has no gradient"
            torch.testing.assert_close(p.grad, q_grad, **FP32, msg=f"{what}: gradient {name}")
