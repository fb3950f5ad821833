"""HybridParallelPlugin at zero_stage 1 and 2 with tp 2 x dp 2 and a whole-tensor optimizer (torch's Muon over the
matrices; cx-zero's MuonWithAdamW over `muon_param_groups`): ZeRO gathers each tp slice whole onto its dp owner, the
owners of one parameter's slices (one tp group) gather them over tp to a tp owner, which steps the whole matrix
(`_tp_zero_whole`), against the same optimizer on one process. Before this the plugin refused the pair. Bounds as
in test_plugins_hybrid_muon.py (Muon: 0.2 of one effective step, derived in
packages/zero/tests/test_zero_low_level_muon.py; the tp partial sums and the dp average change the fp32 gradients by
rounding only) and test_plugins_hybrid_muon_adamw.py (AdamW: 0.2 of lr per step taken). A checkpoint (each rank's
slice of the tp owners' momentum, full over dp) resumes bit-exactly beside the straight run, in bf16 too (the fp32
masters in the checkpoint back on the tp owners). The owner check refuses tp ranks that would own different
parameters' slices, by name. Without the tp step (each dp owner orthogonalising its slice) q_proj fails the bound;
measured worst with it: 0.58x the bound (o_proj). bf16 working weights (fp32 masters, ZeRO-2, torch's Muon) against
one process's emulated mixed-precision step, under the bf16 bound of muon_test_helpers (0.5 of an effective step);
measured worst 0.41x it (o_proj); without the tp step q_proj fails it. cpu_offload (ZeRO-2, MuonWithAdamW) keeps the
masters on the CPU and runs the tp collectives on the communication device, the CPU under gloo, so only a GPU run
checks those copies; without the tp step the embedding fails its bound."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins._layout import Axis
from cx_plugins.hybrid._tp_zero_whole import require_same_owners
from cx_shardformer import get_shard_spec, unshard_tensor
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
    muon_adamw,
    muon_bound,
    one_layer_llama,
    reference_step,
    save_and_load_fresh,
)


@distributed(world_size=4)
@pytest.mark.parametrize(
    ("zero_stage", "case", "cpu_offload"),
    [(1, "muon", False), (2, "muon", False), (2, "muon_adamw", False), (2, "muon_adamw", True)],
)
def test_plugins_hybrid_zero_tp_muon_matches_one_process(
    rank: int, world_size: int, zero_stage: int, case: str, cpu_offload: bool, tmp_path: Path
) -> None:
    """cpu_offload: ZeRO's masters and the optimizer state on the CPU, the tp collectives on the communication
    device (the CPU here too under gloo: this checks the step and the checkpoint with CPU masters, not the moves)."""
    make_model, make_optimizer = ONE_LAYER_CASES[case]
    model = make_model()
    reference = copy.deepcopy(model)
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=1, precision="fp32", zero_stage=zero_stage, cpu_offload=cpu_offload
    )
    assert plugin.data_parallel_rank_and_size()[1] == 2
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, make_optimizer(model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = make_optimizer(reference)
    for step in range(STEPS):
        boosted_step(booster, boosted(**dp_share(plugin, step)).loss, optimizer)
        reference_step(reference(**batch(step)).loss, reference_optimizer)
    muon = {id(p) for g in reference_optimizer.param_groups if g.get("use_muon", True) for p in g["params"]}
    expected = dict(reference.named_parameters())
    tp_group = plugin.layout.group(Axis.TP)
    split = 0
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        split += spec is not None and param.requires_grad
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        want = expected[name]
        bound = muon_bound(MUON_LR, *full.shape) if id(want) in muon else ADAMW_BOUND
        torch.testing.assert_close(full, want.detach(), rtol=0, atol=bound, msg=name)
    assert split >= 7  # q, k, v, o, gate, up, down (and embedding / head) really are split and trained
    resumed, resumed_optimizer = save_and_load_fresh(booster, boosted, optimizer, make_model, make_optimizer, tmp_path)
    assert isinstance(resumed, HybridParallelModule)
    for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, model_(**dp_share(plugin, STEPS)).loss, optimizer_)
    for (name, p), q in zip(boosted.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name


@distributed(world_size=2)
def test_plugins_hybrid_zero_tp_owner_check_names_the_problem(rank: int, world_size: int) -> None:
    require_same_owners(["a.weight", "b.weight"], None, "HybridParallelPlugin")  # the same everywhere: fine
    owned = ["a.weight"] if rank == 0 else ["b.weight"]
    with pytest.raises(ValueError, match=r"HybridParallelPlugin: .*tp ranks of each data-parallel coordinate"):
        require_same_owners(owned, None, "HybridParallelPlugin")


@distributed(world_size=4)
def test_plugins_hybrid_zero_tp_muon_bf16_resumes_exactly(rank: int, world_size: int, tmp_path: Path) -> None:
    """bf16: the checkpoint holds the fp32 masters (ZeRO's dp-whole masters, each rank's tp slice); loaded, they
    reach the tp owners' whole masters again, so the resumed step matches the straight one bit for bit."""
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16", zero_stage=2)
    booster = Booster(plugin=plugin)
    model = one_layer_llama()
    boosted, optimizer, *_ = booster.boost(model, muon_adamw(model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    for step in range(2):
        boosted_step(booster, boosted(**dp_share(plugin, step)).loss, optimizer)
    resumed, resumed_optimizer = save_and_load_fresh(booster, boosted, optimizer, one_layer_llama, muon_adamw, tmp_path)
    assert isinstance(resumed, HybridParallelModule)
    for step in (2, 3):
        for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
            boosted_step(booster, model_(**dp_share(plugin, step)).loss, optimizer_)
    for (name, p), q in zip(boosted.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name


@distributed(world_size=4)
def test_plugins_hybrid_zero_tp_muon_bf16_matches_mixed_precision(rank: int, world_size: int) -> None:
    """bf16 working weights, fp32 masters, ZeRO-2 at tp 2 x dp 2, torch's Muon over the matrices: against one
    process's emulation of the mixed-precision step (`bf16_reference_step`), both sides rounded to bf16."""
    make_model, make_optimizer = ONE_LAYER_CASES["muon"]
    model = make_model()
    reference = copy.deepcopy(model)
    plugin = HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16", zero_stage=2)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, make_optimizer(model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = make_optimizer(reference)
    for step in range(STEPS):
        boosted_step(booster, boosted(**dp_share(plugin, step)).loss, optimizer)
        bf16_reference_step(reference, reference_optimizer, dp_shares(step, 2))
    expected = dict(reference.named_parameters())
    tp_group = plugin.layout.group(Axis.TP)
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        assert full.dtype == torch.bfloat16, name
        bound = muon_bound(MUON_LR, *full.shape, flip=BF16_FLIP_BOUND) if param.requires_grad else 0.0
        assert_close_bf16(full, expected[name], bound, name)
