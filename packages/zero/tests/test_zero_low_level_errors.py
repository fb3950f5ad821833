"""Bad input to LowLevelZeroOptimizer: clear errors on every rank, never a hang."""

from __future__ import annotations

import pytest
import torch

from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed
from cx_zero import LowLevelZeroOptimizer
from zero_test_helpers import batch, local, loss_of, make_mlp, make_model, subgroup, world_group


def _loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
    x, y = batch("mlp", 0, 2)
    return loss_of("mlp", model, local(x, rank, 2), local(y, rank, 2))


@distributed(world_size=2)
def test_zero_rejects_bad_constructor_arguments(rank: int, world_size: int) -> None:
    model = make_mlp()
    params = list(model.parameters())
    world = world_group()
    with pytest.raises(ValueError, match="not both"):
        LowLevelZeroOptimizer(torch.optim.AdamW(params), pg_to_param_list={world: params}, dp_process_group=world)
    with pytest.raises(ValueError, match="extra_dp_group"):
        LowLevelZeroOptimizer(torch.optim.AdamW(params), pg_to_param_list={world: params}, extra_dp_group=world)
    with pytest.raises(ValueError, match="in no pg_to_param_list group"):
        LowLevelZeroOptimizer(torch.optim.AdamW(params), pg_to_param_list={world: params[:2]})
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        LowLevelZeroOptimizer(torch.optim.AdamW(params), reduce_bucket_size=0)
    with pytest.raises(ValueError, match="clip_grad_norm"):  # NaN would silently disable clipping
        LowLevelZeroOptimizer(torch.optim.AdamW(params), clip_grad_norm=float("nan"))
    with pytest.raises(ValueError, match="communication_dtype"):
        LowLevelZeroOptimizer(torch.optim.AdamW(params), communication_dtype=torch.float64)
    with pytest.raises(TypeError, match="LBFGS is not known to be elementwise"):
        LowLevelZeroOptimizer(torch.optim.LBFGS(params))
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        LowLevelZeroOptimizer(params)  # type: ignore[arg-type]
    model.fc1.weight.data = model.fc1.weight.data.half()
    with pytest.raises(ValueError, match="mixed dtypes"):
        LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()))
    used = make_model("mlp")
    optim = torch.optim.AdamW(used.parameters())
    _loss(used, rank).backward()
    optim.step()
    with pytest.raises(ValueError, match="fresh optimizer"):
        LowLevelZeroOptimizer(optim)


@distributed(world_size=2)
def test_zero_rank_mismatch_is_an_error_not_a_hang(rank: int, world_size: int) -> None:
    model = make_model("mlp")
    with pytest.raises(RankMismatchError):
        LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), reduce_bucket_size=10 + rank)


@distributed(world_size=2)
def test_zero_misuse_of_backward_and_no_sync(rank: int, world_size: int) -> None:
    model = make_model("mlp")
    optimizer = LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), module=model)
    with pytest.raises(RuntimeError, match=r"optimizer.backward\(loss\)"):
        _loss(model, rank).backward()
    optimizer.zero_grad()
    with optimizer.no_sync():
        optimizer.backward(_loss(model, rank))
        with pytest.raises(RuntimeError, match="inside no_sync"):
            optimizer.step()
    with pytest.raises(RuntimeError, match="never reduced"):
        optimizer.step()
    optimizer.backward(_loss(model, rank))
    optimizer.step()
    state = optimizer.state_dict()
    state["state"]["fc1.weight"]["exp_avg"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="exp_avg"):
        optimizer.load_state_dict(state)
    state["param_groups"][0]["params"] = ["nope"]
    with pytest.raises(ValueError, match="names differ"):
        optimizer.load_state_dict(state)


@distributed(world_size=4)
def test_zero_rejects_a_group_without_this_rank(rank: int, world_size: int) -> None:
    pair = subgroup((0, 1))
    other = subgroup((2, 3))
    model = make_mlp()
    with pytest.raises(ValueError, match="is not a member"):
        LowLevelZeroOptimizer(torch.optim.AdamW(model.parameters()), dp_process_group=other if rank < 2 else pair)


@distributed(world_size=2)
def test_zero_failed_construction_leaves_the_optimizer_usable(rank: int, world_size: int) -> None:
    """A bad loss-scaler argument (checked for fp16 only) fails before the wrapped optimizer's param groups are
    re-pointed at master shards: the same optimizer can be wrapped again with the argument corrected."""
    model = make_mlp()
    inner = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="growth_factor"):
        LowLevelZeroOptimizer(inner, forced_dtype=torch.float16, growth_factor=0.5)
    assert [p for group in inner.param_groups for p in group["params"]] == list(model.parameters())
    optimizer = LowLevelZeroOptimizer(inner, forced_dtype=torch.float16)
    assert optimizer.loss_scale == 2**16
