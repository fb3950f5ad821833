"""GeminiPlugin with tp 2 x dp 2 and a whole-tensor optimizer (torch's Muon over the matrices; cx-zero's
MuonWithAdamW over `muon_param_groups`): Gemini gathers each tp slice whole from its chunk shards onto a dp owner,
the owners of one parameter's slices (one tp group) gather them over tp to a tp owner, which steps the whole matrix
(`gemini._tp_whole`), against the same optimizer on one process. Before this the plugin refused the pair.
Parameter bounds as in test_plugins_hybrid_zero_tp_muon.py (Muon: 0.2 of one effective step, derived in
packages/zero/tests/test_zero_low_level_muon.py; AdamW: 0.2 of lr per step taken). Each step's loss (the dp ranks'
mean) is held to the first-order effect of those parameter bounds, sum over parameters of |reference gradient|_1 x
bound, plus 2**-16 of the loss for fp32 sums taken in another order (tp partial sums, <= 64 terms: 2**-18 each).
A checkpoint (each rank's slice of the tp owners' momentum, gathered over tp into the canonical files) resumes
bit-exactly beside the straight run. Without the tp gather (each dp owner orthogonalising its tp slice) a matrix
fails its bound (the mutation test below), and the owner check refuses tp ranks owning different parameters. bf16
working weights (fp32 masters, torch's Muon) are held to one process's emulated mixed-precision step under the bf16
bound of muon_test_helpers (0.5 of an effective step); without the tp gather q_proj fails it (checked by hand).
With the optimizer data on the CPU (`offload_optim_frac=1.0`, `auto` placement, or `offload_optim_frac=0.5`: some
chunks' on the CPU, the rest on the device, in one step) the same bounds and resume hold: the dp-whole masters and
the tp owners' state stay on the CPU, the tp collectives run on the communication device (the CPU too under gloo:
only a GPU run checks those copies); without the tp gather the 1.0 and 0.5 cases fail their bounds too (checked by
hand; 0.5: 5.1x). Before this the plugin refused optimizer data on the CPU at tp > 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cx_plugins.gemini._plugin as gemini_plugin
from cx_chunk import Residence
from cx_mesh.testing import distributed
from cx_plugins import Booster, GeminiPlugin
from cx_plugins._layout import Axis
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards
from cx_plugins.gemini._plugin import GeminiModel, GeminiOptimizerWrapper
from cx_plugins.gemini._tp_whole import require_same_owners
from cx_shardformer import get_shard_spec
from hybrid_test_helpers import batch
from muon_test_helpers import (
    ADAMW_BOUND,
    BF16_FLIP_BOUND,
    MUON_LR,
    ONE_LAYER_CASES,
    STEPS,
    assert_close_bf16,
    bf16_reference_step,
    boosted_step,
    dp_share,
    dp_shares,
    muon_bound,
    save_and_load_fresh,
)

pytest.importorskip("transformers")


def _plugin(precision: str = "fp32", **placement: Any) -> GeminiPlugin:
    # 1024-element chunks: most tp slices straddle the two dp ranks' shards
    return GeminiPlugin(precision=precision, tp_size=2, chunk_config_dict={"chunk_size": 1024}, **placement)


def _train(booster: Booster, plugin: GeminiPlugin, model: Any, optimizer: Any, steps: range) -> list[float]:
    """Steps `steps`; the losses, averaged over the dp ranks (equal token counts: the global batch's loss)."""
    losses = []
    group = plugin.layout.group(Axis.ZERO)
    for step in steps:
        loss = model(**dp_share(plugin, step)).loss
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(float(mean) / dist.get_world_size(group))
        boosted_step(booster, loss, optimizer)
    return losses


def _full_params(plugin: GeminiPlugin, model: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective): gathered over the zero group by Gemini, over tp as checkpoints are."""
    assert isinstance(model, GeminiModel)
    state = model.ddp.state_dict(only_rank_0=False)
    local = {name: tuple(t.shape) for name, t in state.items()}
    shards = TensorParallelShards.of_module(model.unwrap(), plugin.layout.group(Axis.TP), local)
    return {name: shards.gather(name, tensor) for name, tensor in state.items()}


def _reference(
    make_model: Callable[[], nn.Module], make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
) -> tuple[nn.Module, torch.optim.Optimizer, list[float], list[dict[str, float]]]:
    """One process: the model, its optimizer, the losses and each step's |gradient|_1 by parameter name."""
    model = make_model()
    optimizer = make_optimizer(model)
    losses, grads = [], []
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        losses.append(float(loss))
        loss.backward()
        grads.append({n: float(p.grad.abs().sum()) for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer, losses, grads


def _bounds(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    muon = {id(p) for g in optimizer.param_groups if g.get("use_muon", True) for p in g["params"]}
    return {
        name: muon_bound(MUON_LR, *p.shape) if id(p) in muon else ADAMW_BOUND
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def _boost(case: str, precision: str = "fp32", **placement: Any) -> tuple[GeminiPlugin, Booster, Any, Any]:
    make_model, make_optimizer = ONE_LAYER_CASES[case]
    plugin = _plugin(precision, **placement)
    booster = Booster(plugin=plugin)
    model = make_model()
    boosted, optimizer, *_ = booster.boost(model, make_optimizer(model))
    assert isinstance(optimizer, GeminiOptimizerWrapper)
    return plugin, booster, boosted, optimizer


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("case", "placement", "residences"),
    [
        ("muon", {}, {Residence.DEVICE}),
        ("muon_adamw", {}, {Residence.DEVICE}),
        ("muon_adamw", {"offload_optim_frac": 1.0}, {Residence.HOST}),
        ("muon_adamw", {"offload_optim_frac": 0.5}, {Residence.HOST, Residence.DEVICE}),
        ("muon", {"placement_policy": "auto"}, {Residence.HOST}),
    ],
    ids=["muon", "muon_adamw", "muon_adamw-offload_optim", "muon_adamw-offload_optim_half", "muon-auto"],
)
def test_plugins_gemini_tp_muon_matches_one_process(
    rank: int, world_size: int, case: str, placement: dict[str, Any], residences: set[Residence], tmp_path: Path
) -> None:
    """`placement` non-empty: the chunks' optimizer data on the CPU, all of it or (offload_optim_frac=0.5) some
    chunks' (the dp-whole masters and the tp owners' state there, the tp collectives on the communication device,
    the CPU too under gloo); the half case steps matrices of both residences in one step."""
    plugin, booster, boosted, optimizer = _boost(case, **placement)
    assert plugin.data_parallel_rank_and_size()[1] == 2
    whole = optimizer.gemini.whole_step
    assert whole is not None
    assert whole.split is not None
    policy = optimizer.gemini.module.policy
    found = {policy.optimizer_residence(w.entry.chunk) for w in whole.params.values()}
    assert found == residences, found
    split = [w for w in whole.params.values() if get_shard_spec(w.entry.param) is not None]
    # both levels run: tp-split matrices whose elements lie in both dp ranks' shards
    assert sum(1 for w in split if sum(1 for b, e in w.spans if e > b) == 2) >= 3
    losses = _train(booster, plugin, boosted, optimizer, range(STEPS))
    reference, reference_optimizer, reference_losses, grads = _reference(*ONE_LAYER_CASES[case])
    bounds = _bounds(reference, reference_optimizer)
    for step, (got, want) in enumerate(zip(losses, reference_losses, strict=True)):
        bound = sum(grads[step][name] * bounds[name] for name in grads[step]) + 2**-16 * abs(want)
        assert abs(got - want) <= bound, (step, got, want, bound)
    full = _full_params(plugin, boosted)
    expected = dict(reference.named_parameters())
    for name, bound in bounds.items():
        torch.testing.assert_close(full[name], expected[name].detach(), rtol=0, atol=bound, msg=name)
    make_model, make_optimizer = ONE_LAYER_CASES[case]
    resumed, resumed_optimizer = save_and_load_fresh(booster, boosted, optimizer, make_model, make_optimizer, tmp_path)
    for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
        _train(booster, plugin, model_, optimizer_, range(STEPS, STEPS + 2))
    continued, loaded = _full_params(plugin, boosted), _full_params(plugin, resumed)
    for name in continued:
        assert torch.equal(continued[name], loaded[name]), name


@distributed(world_size=4)
def test_plugins_gemini_tp_muon_bf16_matches_mixed_precision(rank: int, world_size: int) -> None:
    """bf16 working weights, fp32 masters, torch's Muon over the matrices: against one process's emulation of the
    mixed-precision step (`bf16_reference_step`), both sides rounded to bf16 (bound in muon_test_helpers)."""
    plugin, booster, boosted, optimizer = _boost("muon", "bf16")
    _train(booster, plugin, boosted, optimizer, range(STEPS))
    make_model, make_optimizer = ONE_LAYER_CASES["muon"]
    reference = make_model()
    reference_optimizer = make_optimizer(reference)
    for step in range(STEPS):
        bf16_reference_step(reference, reference_optimizer, dp_shares(step, 2))
    full = _full_params(plugin, boosted)
    for name, param in reference.named_parameters():
        bound = muon_bound(MUON_LR, *param.shape, flip=BF16_FLIP_BOUND) if param.requires_grad else 0.0
        assert_close_bf16(full[name], param, bound, name)


_PATCHED = "GeminiTensorParallelWhole"  # what the plugin builds the tp step with


class _NoTpGather:
    """The mutation: each dp owner steps its tp slice as if it were the whole matrix (no gather over tp)."""

    covers: frozenset[int] = frozenset()

    def __init__(self, *_: Any, **__: Any) -> None:
        pass

    def local_states(self) -> dict[int, dict[str, Any]]:
        return {}

    def load_states(self, local: Any) -> None:
        pass


@distributed(world_size=4)
def test_plugins_gemini_tp_muon_without_the_tp_gather_fails_the_bound(rank: int, world_size: int) -> None:
    saved = getattr(gemini_plugin, _PATCHED)
    setattr(gemini_plugin, _PATCHED, _NoTpGather)
    try:
        plugin, booster, boosted, optimizer = _boost("muon")
        _train(booster, plugin, boosted, optimizer, range(STEPS))
    finally:
        setattr(gemini_plugin, _PATCHED, saved)
    reference, reference_optimizer, *_ = _reference(*ONE_LAYER_CASES["muon"])
    bounds = _bounds(reference, reference_optimizer)
    full = _full_params(plugin, boosted)
    expected = dict(reference.named_parameters())
    worst = max(float((full[n] - expected[n].detach()).abs().max()) / bound for n, bound in bounds.items())
    assert worst > 1.0, worst


@distributed(world_size=2)
def test_plugins_gemini_tp_owner_check_names_the_problem(rank: int, world_size: int) -> None:
    require_same_owners(["a.weight", "b.weight"], None)  # the same everywhere: fine
    owned = ["a.weight"] if rank == 0 else ["b.weight"]
    with pytest.raises(ValueError, match=r"GeminiPlugin: .*tp ranks of each zero-group coordinate"):
        require_same_owners(owned, None)
