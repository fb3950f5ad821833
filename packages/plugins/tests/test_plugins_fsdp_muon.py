"""`booster.boost(model, torch.optim.Muon(matrices))` under TorchFSDPPlugin dp 2 gives one process's result: the
momentum steps on each rank's DTensor rows, each matrix's update is gathered to one owner rank for Newton-Schulz and
its rows scattered back (fsdp/_muon.py); its checkpoint (the momentum gathered by name, as AdamW's states) resumes
bit-exactly. The bound (0.2 of one effective step lr * sqrt(max(1, rows / cols)) per parameter after 3 steps) is
derived in packages/zero/tests/test_zero_low_level_muon.py: bf16 Newton-Schulz turns a rare flipped rounding of its
input (here: FSDP's reduce-scattered mean against the reference's full-batch gradient) into a visible but bounded
difference; slice-wise orthogonalisation is off by far more. The fp32 runs here were bit-identical to the reference
(max difference 0 for every matrix, both wraps, measured), the bound is kept for platforms whose reduction rounds
differently. Row counts 12, 5, 3 and 1 shard unevenly over two ranks
(5 -> 3 + 2 rows, 1 -> 1 + 0); the first linear's bias is frozen (torch's Muon takes only matrices)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from cx_mesh.testing import distributed
from cx_plugins import Booster, ModelWrapper, TorchFSDPPlugin
from muon_test_helpers import (
    STEPS,
    boosted_step,
    muon_bound,
    rank_rows,
    reference_step,
    regression_batch,
    save_and_load_fresh,
    two_lr_muon,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 5, bias=False), nn.Tanh(), nn.Linear(5, 3, bias=False),
        nn.Tanh(), nn.Linear(3, 1, bias=False),
    )  # fmt: skip
    model[0].bias.requires_grad_(False)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


@distributed(world_size=2)
@pytest.mark.parametrize("wrap", ["per_linear", "root"])
def test_plugins_fsdp_muon_matches_one_process(rank: int, world_size: int, wrap: str, tmp_path: Path) -> None:
    policy = ModuleWrapPolicy({nn.Linear}) if wrap == "per_linear" else None
    booster = Booster(plugin=TorchFSDPPlugin(auto_wrap_policy=policy))
    plain = _model()
    model, optimizer, *_ = booster.boost(plain, two_lr_muon(plain))
    assert isinstance(model, ModelWrapper)
    assert optimizer is not None
    reference = _model()
    reference_optimizer = two_lr_muon(reference)
    mine = rank_rows(rank)
    for step in range(STEPS):
        x, y = regression_batch(step, world_size, outputs=1)
        boosted_step(booster, nn.functional.mse_loss(model(x[mine]), y[mine]), optimizer)
        reference_step(nn.functional.mse_loss(reference(x), y), reference_optimizer)
    lrs = {id(p): g["lr"] for g in reference_optimizer.param_groups for p in g["params"]}
    for (name, mine_p), want in zip(model.unwrap().named_parameters(), reference.parameters(), strict=True):
        if want.ndim != 2:
            assert torch.equal(_full(mine_p), want.detach()), name  # frozen
            continue
        bound = muon_bound(lrs[id(want)], *want.shape)
        torch.testing.assert_close(_full(mine_p), want.detach(), rtol=0, atol=bound, msg=name)
    # the momentum is sharded like its parameter (so the checkpoint IO treats it as AdamW's states)
    for group in optimizer.param_groups:
        for param in group["params"]:
            buffer = optimizer.state[param]["momentum_buffer"]
            assert isinstance(buffer, DTensor)
            assert buffer.placements == param.placements
    # the checkpoint IO's own files: a fresh boosted pair resumes bit-exactly
    resumed, resumed_optimizer = save_and_load_fresh(booster, model, optimizer, _model, two_lr_muon, tmp_path)
    assert isinstance(resumed, ModelWrapper)
    x, y = regression_batch(STEPS, world_size, outputs=1)
    for boosted_model, boosted_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, nn.functional.mse_loss(boosted_model(x[mine]), y[mine]), boosted_optimizer)
    for (name, p), q in zip(model.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(_full(p), _full(q)), name
