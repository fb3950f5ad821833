"""GeminiDDP + GeminiOptimizer in fp32 against single-process PyTorch data parallelism: 1e-5 relative per step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import Reference, assert_state_close, batch, lm_loss, local, make_gpt

# fp32 on both sides: the same elementwise work; only the order of the cross-rank gradient sum differs.
RTOL, ATOL = 1e-5, 1e-6
STEPS = 5


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def run_and_compare(rank: int, world_size: int, ddp_kwargs: dict[str, object], steps: int = STEPS) -> GeminiDDP:
    model = make_gpt()
    reference = Reference(make_gpt(), world_size, _adamw)
    ddp = GeminiDDP(model, mixed_precision=torch.float32, **ddp_kwargs)  # type: ignore[arg-type]
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(steps):
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        loss = lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size))
        optimizer.backward(loss)
        optimizer.step()
        reference.step(step)
        assert abs(float(loss) - reference.losses[rank]) <= 1e-5 * abs(reference.losses[rank]) + 1e-6
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")
    return ddp


@distributed(world_size=(1, 2, 4))
@pytest.mark.parametrize("chunk_size", [None, 2048])
def test_zero_gemini_fp32_gpt_matches_reference(rank: int, world_size: int, chunk_size: int | None) -> None:
    config = None if chunk_size is None else {"chunk_size": chunk_size}
    run_and_compare(rank, world_size, {"chunk_config_dict": config})


@distributed(world_size=2)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"enable_async_reduce": False},  # every chunk reduced at the end of backward
        {"strict_ddp_mode": True},  # every chunk kept gathered: plain DDP through the same code
        {"chunk_config_dict": {2: {"chunk_size": 999}}},  # ColossalAI's {world size: config} form, rounded up
        {"chunk_config_dict": None, "min_chunk_size_m": 0.001, "search_range_m": 0.01, "hidden_dim": 16},
        {"verbose": True, "chunk_init_device": torch.device("cpu")},
    ],
    ids=["deferred-reduce", "strict-ddp", "colossal-config", "searched", "verbose"],
)
def test_zero_gemini_fp32_variants(rank: int, world_size: int, kwargs: dict[str, object]) -> None:
    ddp = run_and_compare(rank, world_size, {"chunk_config_dict": {"chunk_size": 2048}, **kwargs}, steps=3)
    keep = bool(kwargs.get("strict_ddp_mode"))
    assert all(c.keep_gathered == keep for c in ddp.manager.chunks())


def _pair_groups(rank: int) -> tuple[object, object]:
    """(zero group, extra group) of `rank` in a 4-rank world: chunks over {0,1}, {2,3}; replicas over {0,2}, {1,3}."""
    zero = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    extra = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return zero[rank // 2], extra[rank % 2]


@distributed(world_size=4)
def test_zero_gemini_fp32_extra_dp_group(rank: int, world_size: int) -> None:
    """Chunks sharded over pairs {0,1}, {2,3}; gradients also averaged over {0,2}, {1,3}: DP over all 4 ranks."""
    zero_group, extra_group = _pair_groups(rank)
    ddp = run_and_compare(
        rank,
        world_size,
        {"chunk_config_dict": {"chunk_size": 2048}, "zero_group": zero_group, "extra_dp_group": extra_group},
        steps=3,
    )
    assert all(c.group_size == 2 for c in ddp.manager.chunks())


@distributed(world_size=4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gemini_extra_dp_replicas_start_identical(rank: int, world_size: int, dtype: torch.dtype) -> None:
    """Every rank builds its model from another seed: the replicas over extra_dp_group (which hold the same sharded
    slices) must still start identical, as documented (and, with bf16, their fp32 masters too)."""
    zero_group, extra_group = _pair_groups(rank)
    ddp = GeminiDDP(
        make_gpt(seed=rank),
        mixed_precision=dtype,
        chunk_config_dict={"chunk_size": 2048},
        zero_group=zero_group,  # type: ignore[arg-type]
        extra_dp_group=extra_group,  # type: ignore[arg-type]
    )
    assert any(not c.keep_gathered and c.group_size == 2 for c in ddp.manager.chunks())
    state = ddp.state_dict(only_rank_0=False)  # from the fp32 masters with bf16
    for name in sorted(state):  # tensor collectives (all_gather_object would need numpy, not a dependency)
        mine = state[name].detach().reshape(-1).float()
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        for other in everyone:
            assert torch.equal(other, mine), name
