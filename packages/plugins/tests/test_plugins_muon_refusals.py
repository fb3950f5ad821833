"""Plugins that would step an optimizer on slices of a matrix refuse one that is not known to be elementwise, by name,
at boost, on every rank: torch's Muon (Newton-Schulz needs each matrix whole) and an optimizer of an unknown class;
otherwise a plugin would train silently wrong (each rank orthogonalising its own slice). HybridParallelPlugin at
every zero_stage (tp slices gathered whole to owner ranks; at zero_stage 1/2 after ZeRO's own gather,
test_plugins_hybrid_zero_tp_muon.py; cpu_offload included), MoeHybridParallelPlugin likewise,
GeminiPlugin (at tp 2: dp owners, then tp owners, test_plugins_gemini_tp_muon.py; optimizer data on the CPU
included, though not `auto` placement's gpu_margin_mem_ratio > 0, which moves state by chunk) and TorchFSDPPlugin
step whole matrices instead (TorchFSDPPlugin steps torch's Muon and cx-zero's MuonWithAdamW itself, so it refuses a
subclass of either, whose step it cannot split)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    MoeHybridParallelPlugin,
    Plugin,
    TorchFSDPPlugin,
)
from cx_zero import MuonWithAdamW, muon_param_groups
from hybrid_test_helpers import llama
from moe_hybrid_test_helpers import mixtral


class _SgdSubclass(torch.optim.SGD):
    """A subclass of an elementwise optimizer: known to be elementwise."""


class _MuonSubclass(torch.optim.Muon):
    """A subclass of torch's Muon: its step may differ from the one TorchFSDPPlugin splits over the shards."""


class _MuonWithAdamWSubclass(MuonWithAdamW):
    """A subclass of cx-zero's MuonWithAdamW: likewise."""


class _Foreign(torch.optim.Optimizer):
    """An optimizer class cx knows nothing about (it might be matrix-wise)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.1})


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)


def _muon_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return MuonWithAdamW(muon_param_groups(model), lr=0.02)


def _muon_subclass(model: nn.Module) -> torch.optim.Optimizer:
    return _MuonSubclass([p for p in model.parameters() if p.ndim == 2], lr=0.02)


def _muon_adamw_subclass(model: nn.Module) -> torch.optim.Optimizer:
    return _MuonWithAdamWSubclass(muon_param_groups(model), lr=0.02)


def _foreign(model: nn.Module) -> torch.optim.Optimizer:
    return _Foreign(list(model.parameters()))


def _refused(plugin: Plugin, build: Callable[[], nn.Module], make: Callable[[nn.Module], torch.optim.Optimizer],
             match: str) -> None:  # fmt: skip
    model = build()
    with pytest.raises(TypeError, match=match):
        Booster(plugin=plugin).boost(model, make(model))


def _linears() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12, bias=False), nn.Tanh(), nn.Linear(12, 4, bias=False))


@distributed(world_size=2)
def test_plugins_refuse_matrix_wise_optimizers_on_slices(rank: int, world_size: int) -> None:
    # every zero_stage steps Muon on whole matrices (test_plugins_hybrid_{,zero_tp_}muon.py, cpu_offload included);
    # an unknown optimizer is refused at every stage
    for stage in (0, 1):
        tp = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zero_stage=stage)
        _refused(tp, lambda: llama(layers=1), _foreign, r"HybridParallelPlugin: _Foreign is not known to be element")
    # MoeHybrid steps whole matrices at tp 1 and at tp 2 with every zero_stage (test_plugins_moe_hybrid_muon.py, pp,
    # sequence parallelism and cpu_offload included); an unknown optimizer is refused
    moe = MoeHybridParallelPlugin(tp_size=2, pp_size=1, ep_size=1, precision="fp32")
    _refused(moe, lambda: mixtral(layers=1), _foreign, r"MoeHybridParallelPlugin: _Foreign is not known.*tp_size > 1")
    # TorchFSDPPlugin steps torch's Muon itself (test_plugins_fsdp_muon.py), not a subclass
    _refused(TorchFSDPPlugin(), _linears, _muon_subclass, r"TorchFSDPPlugin: _MuonSubclass needs each parameter whole")
    _refused(TorchFSDPPlugin(), _linears, _foreign, r"TorchFSDPPlugin: _Foreign is not known to be elementwise")
    # Gemini steps Muon on whole matrices at tp 1 and 2 (test_plugins_gemini_{,tp_}muon.py), optimizer data on the CPU
    # included; `auto` placement's gpu_margin_mem_ratio > 0 stays refused (it moves state by chunk, the state is whole
    # on owner ranks), at tp 2 as at tp 1, for MuonWithAdamW too, by name
    for make, name in ((_muon, "Muon"), (_muon_adamw, "MuonWithAdamW")):
        margin = GeminiPlugin(precision="fp32", tp_size=2, placement_policy="auto", gpu_margin_mem_ratio=0.5)
        model = llama(layers=1)
        with pytest.raises(ValueError, match=rf"GeminiOptimizer: gpu_margin_mem_ratio .*; {name}'s state is whole"):
            Booster(plugin=margin).boost(model, make(model))
    gemini = GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 64})
    _refused(gemini, _linears, _foreign, r"GeminiOptimizer: _Foreign is not known to be elementwise")
    # TorchFSDPPlugin steps MuonWithAdamW itself (test_plugins_fsdp_muon_adamw.py), not a subclass
    match = r"TorchFSDPPlugin: _MuonWithAdamWSubclass needs each parameter whole"
    _refused(TorchFSDPPlugin(), _linears, _muon_adamw_subclass, match)


@distributed(world_size=2)
def test_plugins_hybrid_tp_still_takes_a_subclass_of_an_elementwise_optimizer(rank: int, world_size: int) -> None:
    model = llama(layers=1)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")
    _, optimizer, *_ = Booster(plugin=plugin).boost(model, _SgdSubclass(model.parameters(), lr=0.1))
    assert optimizer is not None
