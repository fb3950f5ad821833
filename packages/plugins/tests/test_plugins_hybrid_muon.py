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
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins._layout import Axis
from cx_shardformer import get_shard_spec, unshard_tensor
from hybrid_test_helpers import batch, llama

LR, STEPS, FLIP_BOUND = 0.02, 3, 0.2


def _matrices_only() -> nn.Module:
    model = llama(layers=1)
    for param in model.parameters():
        param.requires_grad_(param.ndim == 2)
    return model


def _muon(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Muon([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)


def _mine(plugin: HybridParallelPlugin, step: int) -> dict[str, torch.Tensor]:
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = next(iter(batch(step).values())).shape[0] // dp_size
    return {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in batch(step).items()}


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
    boosted, optimizer, *_ = booster.boost(model, _muon(model))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    reference_optimizer = _muon(reference)
    for step in range(STEPS):
        booster.backward(boosted(**_mine(plugin, step)).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        reference(**batch(step)).loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    expected = dict(reference.named_parameters())
    tp_group = plugin.layout.group(Axis.TP)
    split = 0
    for name, param in boosted.unwrap().named_parameters():
        spec = get_shard_spec(param)
        split += spec is not None
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        rows, cols = full.shape if full.ndim == 2 else (1, 1)
        bound = FLIP_BOUND * LR * math.sqrt(max(1.0, rows / cols))
        torch.testing.assert_close(full, expected[name].detach(), rtol=0, atol=bound, msg=name)
    assert split >= (7 if tp == 2 else 0)  # q, k, v, o, gate, up, down (and embedding / head) really are split
    # checkpoint: each rank saves its slice of the owners' momentum; a fresh pair resumes bit-exactly
    booster.save_model(boosted, tmp_path / "model", shard=True)
    booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)
    torch.distributed.barrier()
    fresh = _matrices_only()
    resumed, resumed_optimizer, *_ = booster.boost(fresh, _muon(fresh))
    assert isinstance(resumed, HybridParallelModule)
    assert resumed_optimizer is not None
    booster.load_model(resumed, tmp_path / "model")
    booster.load_optimizer(resumed_optimizer, tmp_path / "optimizer")
    for model_, optimizer_ in ((boosted, optimizer), (resumed, resumed_optimizer)):
        booster.backward(model_(**_mine(plugin, STEPS)).loss, optimizer_)
        optimizer_.step()
        optimizer_.zero_grad()
    for (name, p), q in zip(boosted.unwrap().named_parameters(), resumed.unwrap().parameters(), strict=True):
        assert torch.equal(p, q), name
