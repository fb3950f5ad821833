"""HybridParallelPlugin (tp 2 at zero_stage 0; tp 1 with ZeRO-1 over dp 2) with cx-zero's MuonWithAdamW over
`muon_param_groups`: nothing frozen (the norms, the embedding and the head follow AdamW), against the same optimizer on
one process. Each tp-split tensor, AdamW's included, is gathered whole to one owner rank and stepped there
(`_tp_whole`); at tp 1, ZeRO-1 steps every parameter whole on its dp owner (`_whole_step`). Bounds as in
test_plugins_hybrid_muon.py (Muon: 0.2 of one effective step, derived in
packages/zero/tests/test_zero_low_level_muon.py) and test_plugins_zero_muon_adamw.py (AdamW: 0.2 of lr per
step taken); measured worst at tp 2: 0.58x the bound (o_proj), the AdamW tensors 0.013x. A checkpoint (AdamW's
scalar `step` beside the sliced states) resumes bit-exactly."""

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
    ADAMW_BOUND,
    MUON_LR,
    STEPS,
    boosted_step,
    dp_share,
    muon_adamw,
    muon_bound,
    reference_step,
    save_and_load_fresh,
)


def _llama() -> nn.Module:
    return llama(layers=1)


@distributed(world_size=2)
@pytest.mark.parametrize(("tp", "zero_stage"), [(2, 0), (1, 1)])
def test_plugins_hybrid_muon_adamw_matches_one_process(
    rank: int, world_size: int, tp: int, zero_stage: int, tmp_path: Path
) -> None:
    model = llama(layers=1)
    reference = copy.deepcopy(model)
    plugin = HybridParallelPlugin(tp_size=tp, pp_size=1, precision="fp32", zero_stage=zero_stage)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, muon_adamw(model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = muon_adamw(reference)
    for step in range(STEPS):
        boosted_step(booster, boosted(**dp_share(plugin, step)).loss, optimizer)
        reference_step(reference(**batch(step)).loss, reference_optimizer)
    muon = {id(p) for g in reference_optimizer.param_groups if g["use_muon"] for p in g["params"]}
    expected = dict(reference.named_parameters())
    assert any("embed" in name for name, p in expected.items() if id(p) not in muon)
    tp_group = plugin.layout.group(Axis.TP)
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        want = expected[name]
        bound = muon_bound(MUON_LR, *full.shape) if id(want) in muon else ADAMW_BOUND
        torch.testing.assert_close(full, want.detach(), rtol=0, atol=bound, msg=name)
    resumed, resumed_optimizer = save_and_load_fresh(booster, boosted, optimizer, _llama, muon_adamw, tmp_path)
    assert isinstance(resumed, HybridParallelModule)
    for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
        boosted_step(booster, model_(**dp_share(plugin, STEPS)).loss, optimizer_)
    for (name, p), q in zip(boosted.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name
