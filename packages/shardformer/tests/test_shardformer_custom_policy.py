"""A hand-written Policy on a plain torch model (no transformers): module classes matched by type and by name,
sub-module replacement with kwargs (nested suffixes, ignore_if_not_exist), attribute and method replacement. This is
the interface MoE policies plug into; the sharded model trains like the unsharded one at tp 2."""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh.testing import distributed
from cx_shardformer import (
    Linear1D_Col,
    Linear1D_Row,
    ModulePolicyDescription,
    Policy,
    ShardConfig,
    ShardFormer,
    SubModuleReplacementDescription,
)
from cx_shardformer.policies import register_policy
from shardformer_helpers import assert_close
from shardformer_models import compare_grads


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.width = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.mlp(self.norm(x))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def _describe(self: Mlp) -> str:
    return f"sharded mlp of local width {self.width}"


class NetPolicy(Policy):
    def config_sanity_check(self) -> None:
        if 16 % self.shard_config.tensor_parallel_size:
            raise ValueError("Net: width 16 does not divide")

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        tp = self.shard_config.tensor_parallel_size
        return {
            Block: ModulePolicyDescription(
                attribute_replacement={"mlp.width": 16 // tp},
                sub_module_replacement=[
                    SubModuleReplacementDescription("mlp.up", Linear1D_Col),
                    SubModuleReplacementDescription("mlp.down", Linear1D_Row),
                    SubModuleReplacementDescription("mlp.gate", Linear1D_Col, ignore_if_not_exist=True),
                ],
            ),
            "Mlp": ModulePolicyDescription(method_replacement={"describe": _describe}),
        }


@distributed(world_size=2)
def test_shardformer_custom_policy_on_a_plain_model(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    net = Net()
    reference = copy.deepcopy(net)
    model, shared = ShardFormer(ShardConfig()).optimize(net, NetPolicy())
    assert shared == []
    block: Any = net.blocks[0]
    assert type(block.mlp.up) is Linear1D_Col
    assert type(block.mlp.down) is Linear1D_Row
    assert block.mlp.width == 8
    describe = block.mlp.describe
    assert isinstance(describe, types.MethodType)
    assert describe() == "sharded mlp of local width 8"
    torch.manual_seed(1)
    x = torch.randn(4, 5, 8)
    out, ref_out = model(x), reference(x)
    assert_close(out, ref_out.detach(), "output")
    out.square().mean().backward()
    ref_out.square().mean().backward()
    compare_grads(model, reference, "custom policy")


@distributed(world_size=2)
def test_shardformer_registered_policy_is_auto_selected(rank: int, world_size: int) -> None:
    register_policy("Net", NetPolicy)
    register_policy("Net", NetPolicy)  # the same factory again is fine
    with pytest.raises(ValueError, match="already registered"):
        register_policy("Net", MissingPolicy)
    net = Net()
    ShardFormer(ShardConfig()).optimize(net)
    block: Any = net.blocks[0]
    assert type(block.mlp.up) is Linear1D_Col


class MissingPolicy(NetPolicy):
    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        return {
            Block: ModulePolicyDescription(
                sub_module_replacement=[SubModuleReplacementDescription("mlp.gate", Linear1D_Col)]
            )
        }


@distributed(world_size=2)
def test_shardformer_custom_policy_missing_submodule(rank: int, world_size: int) -> None:
    with pytest.raises(AttributeError, match=r"Block at 'blocks\.0' has no sub-module 'mlp\.gate'"):
        ShardFormer(ShardConfig()).optimize(Net(), MissingPolicy())
