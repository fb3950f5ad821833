"""LowLevelZeroOptimizer around MuonWithAdamW: the AdamW groups (embedding, biases, norm, head) step on ZeRO's flat
element shards, each rank holding 1/dp of their moments and masters, and only the Muon matrices go whole to an owner
rank; the result equals one process, and equals bit for bit the earlier layout that stepped every parameter whole
(still reachable by declaring the instance whole-tensor), whose checkpoints load unchanged.

Tolerance against one process, as in test_zero_low_level_muon.py (derived there) and the plugin Muon tests: 0.2 of
one effective Muon step lr * sqrt(max(1, rows / cols)) per matrix, 0.2 of lr per step taken per AdamW parameter (a
flipped bf16 rounding in Newton-Schulz changes the gradients that reach them). Against the whole-stepped layout the
comparison is exact: AdamW's arithmetic is elementwise, so a slice of its update is the update of the slice, and the
gradients and Muon steps are the same operations in the same order.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer, MuonWithAdamW, declare_whole_tensor, elementwise_groups, muon_param_groups

MUON_LR, ADAMW_LR, STEPS, PER_RANK, FLIP_BOUND, VOCAB = 0.02, 0.003, 3, 2, 0.2, 37


class _Tiny(nn.Module):
    """An embedding large beside the rest (296 of the AdamW groups' 522 elements), two hidden matrices straddling the
    ranks' flat shards, biases, a norm and a head; odd sizes, so the shards end in padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.up = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, 5)
        self.lm_head = nn.Linear(5, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.down(self.norm(torch.tanh(self.up(self.embed(tokens))))))
        return torch.as_tensor(self.lm_head(hidden))


def _optimizer(model: nn.Module) -> MuonWithAdamW:
    return MuonWithAdamW(muon_param_groups(model), lr=MUON_LR, weight_decay=0.01, adamw_lr=ADAMW_LR)


def _loss(model: nn.Module, step: int, rows: slice) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (2 * PER_RANK * 2, 4), generator=torch.Generator().manual_seed(step))[rows]
    logits = model(tokens).float()
    return nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def _train(model: nn.Module, optimizer: LowLevelZeroOptimizer, steps: range, rank: int, world_size: int) -> None:
    share = 2 * PER_RANK * 2 // world_size  # the global batch of dp 4 split over `world_size` ranks
    for step in steps:
        optimizer.backward(_loss(model, step, slice(rank * share, (rank + 1) * share)))
        optimizer.step()
        optimizer.zero_grad()


def _zero(model: nn.Module, stage: int, *, whole: bool = False, **kwargs: Any) -> LowLevelZeroOptimizer:
    """LowLevelZero around MuonWithAdamW; `whole`: declared whole-tensor, so every group is stepped whole (the layout
    before the AdamW groups were sharded)."""
    inner = _optimizer(model)
    return LowLevelZeroOptimizer(
        declare_whole_tensor(inner) if whole else inner, partition_grad=stage == 2, module=model, **kwargs
    )


def _bound(param: torch.Tensor, muon: bool, steps: int) -> float:
    """0.2 of one effective Muon step of a matrix, 0.2 of lr per step taken of an AdamW parameter (module docs)."""
    if muon:
        rows, cols = param.shape
        return FLIP_BOUND * MUON_LR * math.sqrt(max(1.0, rows / cols))
    return FLIP_BOUND * ADAMW_LR * steps


def _adamw_state_numel(optimizer: LowLevelZeroOptimizer) -> int:
    """Elements of the AdamW moments this rank holds."""
    adamw = [p for g in optimizer.optim.param_groups if not g["use_muon"] for p in g["params"]]
    return sum(v.numel() for p in adamw for k, v in optimizer.optim.state.get(p, {}).items() if k != "step")


def test_elementwise_groups_are_typed_per_group() -> None:
    model = _Tiny()
    assert elementwise_groups(_optimizer(model)) == [False, True]  # Muon group, AdamW group
    assert elementwise_groups(declare_whole_tensor(_optimizer(model))) == [False, False]
    assert elementwise_groups(torch.optim.Muon([model.up.weight])) == [False]
    assert elementwise_groups(torch.optim.AdamW(model.parameters())) == [True]
    with pytest.raises(TypeError, match="not known to be elementwise"):
        elementwise_groups(torch.optim.LBFGS(model.parameters()))


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("stage", [1, 2])
def test_zero_muon_adamw_shards_the_adamw_groups(rank: int, world_size: int, stage: int) -> None:
    model, old = _Tiny(), _Tiny()
    optimizer, old_optimizer = _zero(model, stage), _zero(old, stage, whole=True)
    _train(model, optimizer, range(STEPS), rank, world_size)
    _train(old, old_optimizer, range(STEPS), rank, world_size)
    reference = _Tiny()
    reference_optimizer = _optimizer(reference)
    for step in range(STEPS):
        _loss(reference, step, slice(None)).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    kinds = {id(p): g["use_muon"] for g in reference_optimizer.param_groups for p in g["params"]}
    for (name, mine), was, want in zip(model.named_parameters(), old.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, was), name  # the same as stepping every parameter whole
        bound = _bound(want, kinds[id(want)], STEPS)
        torch.testing.assert_close(mine.detach(), want.detach(), rtol=0, atol=bound, msg=name)
    # measured: each rank holds its flat slice of both AdamW moments of every AdamW parameter ...
    adamw = [p for p in reference.parameters() if not kinds[id(p)]]
    group_numel = sum(p.numel() for p in adamw)
    mine_numel = _adamw_state_numel(optimizer)
    assert mine_numel == 2 * sum(-(-p.numel() // world_size) for p in adamw)
    assert mine_numel <= 2 * (group_numel / world_size + len(adamw))  # 1/dp, plus at most one padding element each
    counts = torch.tensor([mine_numel, _adamw_state_numel(old_optimizer)])
    gathered = [torch.zeros_like(counts) for _ in range(world_size)]
    dist.all_gather(gathered, counts)
    assert max(int(c[0]) for c in gathered) < 2 * group_numel / world_size + 2 * len(adamw)
    assert max(int(c[1]) for c in gathered) >= 2 * 296  # before: the embedding's moments whole on its owner
    # ... and the Muon momenta stay whole, each on exactly one rank
    momenta = [s["momentum_buffer"] for s in optimizer.optim.state.values() if "momentum_buffer" in s]
    assert all(b.dim() == 2 for b in momenta)
    held = torch.tensor([len(momenta)])
    dist.all_reduce(held)
    assert int(held) == 2


@distributed(world_size=2)
@pytest.mark.parametrize(("dtype", "stage"), [(torch.float32, 2), (torch.bfloat16, 1)])
def test_zero_muon_adamw_loads_the_whole_stepped_checkpoint(
    rank: int, world_size: int, dtype: torch.dtype, stage: int
) -> None:
    """The state dict has the same names, entries and shapes as the earlier whole-stepped layout's (full tensors by
    parameter name, fp32 masters with bf16), equal values after the same steps, and either loads into the other:
    the next step is bit-identical to the uninterrupted run's."""
    old, model = _Tiny().to(dtype), _Tiny().to(dtype)
    old_optimizer, optimizer = _zero(old, stage, whole=True), _zero(model, stage)
    _train(old, old_optimizer, range(2), rank, world_size)
    _train(model, optimizer, range(2), rank, world_size)
    saved_old, saved_new = old_optimizer.state_dict(), optimizer.state_dict()
    assert saved_old["param_groups"] == saved_new["param_groups"]
    assert saved_old["state"].keys() == saved_new["state"].keys()
    for key, entry in saved_old["state"].items():
        assert entry.keys() == saved_new["state"][key].keys(), key
        for name, value in entry.items():
            assert torch.equal(value, saved_new["state"][key][name]), (key, name)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for saved, whole in ((saved_old, False), (saved_new, True)):  # old checkpoint -> new layout, and back
        resumed = _Tiny().to(dtype)
        resumed.load_state_dict(weights)
        resumed_optimizer = _zero(resumed, stage, whole=whole)
        resumed_optimizer.load_state_dict(saved)
        _train(resumed, resumed_optimizer, range(2, 3), rank, world_size)
        if not whole:
            _train(model, optimizer, range(2, 3), rank, world_size)
        for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
            assert torch.equal(p, q), name


@distributed(world_size=2)
def test_zero_muon_adamw_state_saved_at_dp2_continues_at_dp1(rank: int, world_size: int) -> None:
    """The dp-2 state (AdamW moments gathered from both ranks' slices) loads into a one-replica group and continues
    like dp 2 within the bounds above."""
    model = _Tiny()
    optimizer = _zero(model, 2)
    _train(model, optimizer, range(2), rank, world_size)
    saved = optimizer.state_dict()
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    single = _Tiny()
    single.load_state_dict(model.state_dict())
    single_optimizer = _zero(single, 1, dp_process_group=alone)
    single_optimizer.load_state_dict(saved)
    _train(model, optimizer, range(2, 3), rank, world_size)
    _train(single, single_optimizer, range(2, 3), 0, 1)
    for (name, mine), want in zip(single.named_parameters(), model.parameters(), strict=True):
        bound = _bound(want, name in ("up.weight", "down.weight"), 1)
        torch.testing.assert_close(mine.detach(), want.detach(), rtol=0, atol=bound, msg=name)
