"""`booster.boost(model, torch.optim.Muon(matrices))` under GeminiPlugin dp 2 gives one process's result: each
matrix is gathered whole from the chunk shards to one owner rank, stepped there and scattered back (cx_zero's
`gemini._whole`). The model and the bound (0.2 of one effective step lr * sqrt(max(1, rows / cols)) per parameter
after 3 steps) are those of packages/zero/tests/test_zero_low_level_muon.py, where the bound is derived: bf16
Newton-Schulz turns a rare flipped rounding of its input into a visible but bounded difference; slice-wise
orthogonalisation is off by far more (the fp32 runs here were bit-identical to the reference). bf16 is held to a
one-process emulation of mixed precision (bf16 micro-batch gradients averaged in bf16, Muon on fp32 masters): against
the fp32 reference it is off by 0.26 of an effective step, as LowLevelZero's bf16 is (0.28, measured). Chunks of 128
elements make the 12 x 8 and the 3 x 5 matrices straddle the two ranks' shards and leave the 5 x 12 one wholly on
rank 0; keep_gathered chunks hold every matrix whole on both ranks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, GeminiPlugin, ModelWrapper
from cx_plugins.gemini._plugin import GeminiOptimizerWrapper
from muon_test_helpers import (
    MUON_LR,
    STEPS,
    boosted_step,
    muon_bound,
    rank_rows,
    regression_batch,
    save_and_load_fresh,
    tiny_matrices,
    two_lr_muon,
)
from plugins_test_helpers import full_state

CHUNK = 128


def _plugin(precision: str, keep_gathered: bool = False, **placement: Any) -> GeminiPlugin:
    chunks = {"chunk_size": CHUNK, "keep_gathered": keep_gathered}
    return GeminiPlugin(precision=precision, chunk_config_dict=chunks, **placement)


def _train(rank: int, world_size: int, booster: Booster, model: nn.Module, optimizer: Any, steps: range) -> None:
    mine = rank_rows(rank)
    for step in steps:
        x, y = regression_batch(step, world_size)
        out = model(x[mine].to(next(model.parameters()).dtype))
        boosted_step(booster, nn.functional.mse_loss(out.float(), y[mine]), optimizer)


def _reference(world_size: int, precision: str) -> nn.Module:
    """One process's torch Muon; for bf16 it emulates the mixed-precision run: each rank's micro-batch through a bf16
    copy of the fp32 masters, the bf16 gradients summed and averaged in bf16, Muon stepping the fp32 masters."""
    model = tiny_matrices()
    optimizer = two_lr_muon(model)
    for step in range(STEPS):
        x, y = regression_batch(step, world_size)
        if precision == "fp32":
            nn.functional.mse_loss(model(x), y).backward()
        else:
            total: list[torch.Tensor] = []
            for rank in range(world_size):
                work = copy.deepcopy(model).to(torch.bfloat16)
                mine = rank_rows(rank)
                nn.functional.mse_loss(work(x[mine].bfloat16()).float(), y[mine]).backward()
                grads = [p.grad for p in work.parameters() if p.grad is not None]
                total = grads if not total else [a + b for a, b in zip(total, grads, strict=True)]
            for param, grad in zip(model.parameters(), total, strict=True):
                param.grad = (grad / world_size).float()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _straddles(optimizer: Any) -> list[str]:
    """The parameters whose elements lie in both ranks' shards of their chunk (all local when kept gathered)."""
    assert isinstance(optimizer, GeminiOptimizerWrapper)
    whole = optimizer.gemini.whole_step
    assert whole is not None
    assert all(w.local == (not w.spans) for w in whole.params.values())
    return [w.entry.name for w in whole.params.values() if sum(1 for b, e in w.spans if e > b) == 2]


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("precision", "placement"),
    [("fp32", {}), ("bf16", {}), ("fp32", {"offload_optim_frac": 1.0}), ("fp32", {"keep_gathered": True})],
)
def test_plugins_gemini_muon_matches_one_process(
    rank: int, world_size: int, precision: str, placement: dict[str, Any], tmp_path: Path
) -> None:
    booster = Booster(plugin=_plugin(precision, **placement))
    plain = tiny_matrices()
    model, optimizer, *_ = booster.boost(plain, two_lr_muon(plain))
    assert isinstance(model, ModelWrapper)
    assert optimizer is not None
    # kept gathered, every rank holds and steps every matrix whole
    assert _straddles(optimizer) == ([] if placement.get("keep_gathered") else ["0.weight", "4.weight"])
    _train(rank, world_size, booster, model, optimizer, range(STEPS))
    reference = _reference(world_size, precision)
    lrs = {id(p): g["lr"] for g in two_lr_muon(reference).param_groups for p in g["params"]}
    # bf16: both sides are rounded to bf16 before comparing, each off by at most half an ulp (2**-8 relative)
    rtol = 2**-7 if precision == "bf16" else 0.0
    state = full_state(model)
    for name, want in reference.named_parameters():
        bound = muon_bound(lrs[id(want)], *want.shape)
        expected = want.detach().to(state[name].dtype).float()
        torch.testing.assert_close(state[name].float(), expected, rtol=rtol, atol=bound, msg=name)
    # the checkpoint IO's own files (no pickle): a fresh boosted pair resumes bit-exactly (the momentum saved whole
    # by name from its owner, loaded onto the fresh pair's owner)
    resumed, resumed_optimizer = save_and_load_fresh(booster, model, optimizer, tiny_matrices, two_lr_muon, tmp_path)
    assert isinstance(resumed, ModelWrapper)
    for boosted_model, boosted_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
        _train(rank, world_size, booster, boosted_model, boosted_optimizer, range(STEPS, STEPS + 2))
    continued, loaded = full_state(model), full_state(resumed)
    for name in continued:
        assert torch.equal(continued[name], loaded[name]), name


@distributed(world_size=2)
def test_plugins_gemini_muon_clips_before_the_whole_step(rank: int, world_size: int) -> None:
    """max_norm clips the reduced gradient slices by the global norm before they are gathered whole: the result is
    one process's torch Muon after `clip_grad_norm_` (same bound; 0.05 clips every step here)."""
    booster = Booster(plugin=_plugin("fp32", max_norm=0.05))
    plain = tiny_matrices()
    model, optimizer, *_ = booster.boost(plain, two_lr_muon(plain))
    _train(rank, world_size, booster, model, optimizer, range(STEPS))
    reference = tiny_matrices()
    reference_optimizer = two_lr_muon(reference)
    norms = []
    for step in range(STEPS):
        x, y = regression_batch(step, world_size)
        nn.functional.mse_loss(reference(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(reference.parameters(), 0.05)))
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert min(norms) > 0.05  # every step was clipped
    state = full_state(model)
    lrs = (2 * MUON_LR, MUON_LR, MUON_LR)
    for (name, want), lr in zip(reference.named_parameters(), lrs, strict=True):
        bound = muon_bound(lr, *want.shape)
        torch.testing.assert_close(state[name], want.detach(), rtol=0, atol=bound, msg=name)


@distributed(world_size=2)
def test_plugins_gemini_muon_fp16_overflow_skips_the_step(rank: int, world_size: int) -> None:
    """An inf gradient on one rank (fp16 loss scaling) skips the whole step on every rank: parameters unchanged, no
    momentum built, the scale backed off; the next finite step steps as usual."""
    booster = Booster(plugin=_plugin("fp16", initial_scale=2**8, hysteresis=1))
    plain = tiny_matrices()
    model, optimizer, *_ = booster.boost(plain, two_lr_muon(plain))
    assert isinstance(optimizer, GeminiOptimizerWrapper)
    before = full_state(model)
    x, y = regression_batch(0, world_size)
    mine = rank_rows(rank)
    inputs = x[mine].half()
    if rank == 1:
        inputs[0, 0] = float("inf")
    boosted_step(booster, nn.functional.mse_loss(model(inputs).float(), y[mine]), optimizer)
    after = full_state(model)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert not optimizer.gemini.optim.state
    assert optimizer.gemini.loss_scale == 2**7
    _train(rank, world_size, booster, model, optimizer, range(1))
    assert any(not torch.equal(before[name], value) for name, value in full_state(model).items())
    whole = optimizer.gemini.whole_step
    assert whole is not None
    owned = [w for w in whole.params.values() if w.mine]
    assert all("momentum_buffer" in optimizer.gemini.optim.state[w.tensor] for w in owned)
