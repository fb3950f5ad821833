"""HybridParallelPlugin tp 2 (zero_stage 0) with torch's Muon: each tp-split matrix gathered whole to one owner rank,
orthogonalised there, the slices sent back (`_tp_whole`), against torch's Muon on one process; before this the
plugin trained silently wrong (Newton-Schulz on each rank's slice: every tensor off, the embedding by 0.45 of its
update). The norm weights are frozen on both sides (torch's Muon takes only matrices). The bound (0.2 of one
effective step lr * sqrt(max(1, rows / cols)) per parameter after 3 steps) is derived in
packages/zero/tests/test_zero_low_level_muon.py; the tp partial sums change the fp32 gradients by rounding only.
Without `_tp_whole` (Newton-Schulz per slice) q_proj is off by 4x that bound; with it the worst is 0.43x (o_proj).
A checkpoint (each rank's slice of the owners' momentum) resumes bit-exactly. The same test at tp 1 with ZeRO-1 over
dp 2 (each rank half the batch; the dp sum too changes the gradients by rounding only) covers the zero_stage > 0 path,
LowLevelZero's `_whole_step` under HybridParallelPlugin and its checkpoint IO."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins._layout import Axis
from cx_shardformer import get_shard_spec, unshard_tensor
from hybrid_test_helpers import batch, llama
from muon_test_helpers import (
    MUON_LR,
    STEPS,
    boosted_step,
    dp_share,
    freeze_all_but_matrices,
    muon_bound,
    reference_step,
    save_and_load_fresh,
    torch_muon,
)


def _matrices_only() -> nn.Module:
    return freeze_all_but_matrices(llama(layers=1))


@distributed(world_size=2)
@pytest.mark.parametrize(("tp", "zero_stage"), [(2, 0), (1, 1)])
def test_plugins_hybrid_muon_matches_one_process(
    rank: int, world_size: int, tp: int, zero_stage: int, tmp_path: Path
) -> None:
    """tp 2: matrices gathered over tp (`_tp_whole`); tp 1 with ZeRO-1 over dp 2: LowLevelZero's `_whole_step`."""
    model = _matrices_only()
    reference = copy.deepcopy(model)
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=1, precision="fp32", zero_stage=zero_stage)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch_muon(model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = torch_muon(reference)
    for step in range(STEPS):
        boosted_step(booster, boosted(**dp_share(plugin, step)).loss, optimizer)
        reference_step(reference(**batch(step)).loss, reference_optimizer)
    expected = dict(reference.named_parameters())
    tp_group = plugin.layout.group(Axis.TP)
    split = 0
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        split += spec is not None
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        rows, cols = full.shape if full.ndim == 2 else (1, 1)
        bound = muon_bound(MUON_LR, rows, cols)
        torch.testing.assert_close(full, expected[name].detach(), rtol=0, atol=bound, msg=name)
    assert split >= (7 if tp == 2 else 0)  # q, k, v, o, gate, up, down (and embedding / head) really are split
    # checkpoint: each rank saves its slice of the owners' momentum; a fresh pair resumes bit-exactly
    resumed, resumed_optimizer = save_and_load_fresh(booster, boosted, optimizer, _matrices_only, torch_muon, tmp_path)
    assert isinstance(resumed, HybridParallelModule)
    for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, model_(**dp_share(plugin, STEPS)).loss, optimizer_)
    for (name, p), q in zip(boosted.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name
