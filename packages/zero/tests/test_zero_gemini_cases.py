"""The cases users hit: unused parameters, ranks on different paths, tied weights, frozen parameters and buffers,
gradient accumulation, eval / no_grad forwards between steps. fp32 against PyTorch at 1e-5 relative."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer, PathMismatchError
from zero_gemini_helpers import GPT, Reference, assert_state_close, batch, lm_loss, local, make_gpt, train_step

RTOL, ATOL = 1e-5, 1e-6
CONFIGS = [None, {"chunk_size": 2048}]  # one replicated chunk (small model) / several sharded chunks


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


class BranchGPT(GPT):
    """A GPT with two extra heads: `use` picks which one runs; a frozen embedding scale; a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.branch_a = nn.Linear(16, 16)
        self.branch_b = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)  # never used at all
        self.wpe.weight.requires_grad_(False)  # frozen
        self.register_buffer("gain", torch.full((16,), 0.5))

    def forward(self, tokens: torch.Tensor, use: str = "a") -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(self.pos[: tokens.shape[1]]) * self.gain
        x = x + (self.branch_a(x) if use == "a" else self.branch_b(x))
        for block in self.h:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def _branch_gpt() -> BranchGPT:
    torch.manual_seed(0)
    return BranchGPT()


@distributed(world_size=2)
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_gemini_cases_unused_frozen_buffers(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    reference = Reference(_branch_gpt(), world_size, _adamw)
    model = _branch_gpt()
    ddp = GeminiDDP(model, chunk_config_dict=config, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    frozen_chunks = ddp.manager.chunks("frozen")
    assert [t for c in frozen_chunks for t in c.tensors] == [model.wpe.weight]  # not in trained chunks
    for step, use in enumerate(["a", "b", "a"]):  # the same branch on every rank, a different one per step
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        optimizer.backward(lm_loss(ddp(local(x, rank, world_size), use=use), local(y, rank, world_size)))
        optimizer.step()
        reference.step(step, use=use)
        state = ddp.state_dict(only_rank_0=False)
        assert "gain" in state
        assert_state_close(state, reference.state(), RTOL, ATOL, f"step {step}")
    torch.manual_seed(1)
    fresh = GeminiDDP(BranchGPT(), chunk_config_dict=config, mixed_precision=torch.float32)
    with torch.no_grad():
        fresh.module.gain.fill_(3.0)  # type: ignore[operator]
    fresh.load_state_dict(state)  # frozen parameter and buffer come back too
    assert_state_close(fresh.state_dict(only_rank_0=False), state, 0, 0, "loaded")


@distributed(world_size=2)
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_gemini_cases_different_paths_raise(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    ddp = GeminiDDP(_branch_gpt(), chunk_config_dict=config, mixed_precision=torch.float32)
    x, _ = batch(0, world_size)
    with pytest.raises(PathMismatchError, match=r"different paths.*branch_a\.weight.*branch_b\.weight"):
        ddp(local(x, rank, world_size), use="a" if rank == 0 else "b")


@distributed(world_size=2)
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_gemini_cases_tied_weights(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    model = make_gpt()
    ddp = GeminiDDP(model, chunk_config_dict=config, mixed_precision=torch.float32)
    chunked = [t for c in ddp.manager.chunks() for t in c.tensors]
    assert sum(t is model.wte.weight for t in chunked) == 1  # stored once
    assert model.lm_head.weight is model.wte.weight
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    x, y = batch(0, world_size)
    optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
    optimizer.step()
    state = ddp.state_dict(only_rank_0=False)
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])  # saved under both names
    fresh = GeminiDDP(make_gpt(seed=5), chunk_config_dict=config, mixed_precision=torch.float32)
    result = fresh.load_state_dict(state)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    assert_state_close(fresh.state_dict(only_rank_0=False), state, 0.0, 0.0, "loaded")
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), ddp(x), rtol=0.0, atol=0.0)
    # a checkpoint with only one of the two names loads too (torch's own tied checkpoints may carry either)
    single = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert (
        GeminiDDP(make_gpt(seed=6), chunk_config_dict=config, mixed_precision=torch.float32)
        .load_state_dict(single)
        .missing_keys
        == []
    )


@distributed(world_size=2)
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_gemini_cases_gradient_accumulation(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    micro, k = 2, 2
    reference = Reference(make_gpt(), world_size, _adamw)
    ddp = GeminiDDP(
        make_gpt(), chunk_config_dict=config, mixed_precision=torch.float32, enable_gradient_accumulation=True
    )
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        x, y = batch(step, world_size, micro * k)
        xr, yr = local(x, rank, world_size), local(y, rank, world_size)
        optimizer.zero_grad()
        for j in range(k):
            part = slice(j * micro, (j + 1) * micro)
            optimizer.backward(lm_loss(ddp(xr[part]), yr[part]) / k)
        optimizer.step()
        reference.apply(reference.grads(step, micro * k))
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")


@distributed(world_size=2)
def test_zero_gemini_cases_second_backward_without_accumulation_raises(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32)
    x, y = batch(0, world_size)
    ddp.backward(lm_loss(ddp(x), y))
    with pytest.raises(RuntimeError, match="enable_gradient_accumulation=True"):
        ddp.backward(lm_loss(ddp(x), y))


@distributed(world_size=2)
@pytest.mark.parametrize(("max_prefetch", "mode"), [(0, "no_grad"), (2, "no_grad"), (0, "inference_mode")])
def test_zero_gemini_cases_eval_between_steps(rank: int, world_size: int, max_prefetch: int, mode: str) -> None:
    reference = Reference(make_gpt(), world_size, _adamw)
    ddp = GeminiDDP(
        make_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.float32, max_prefetch=max_prefetch
    )
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    probe, _ = batch(99, 1)
    for step in range(3):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
        got_grad_enabled = ddp(probe)  # a forward with grad enabled whose graph is dropped
        ddp.eval()
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            got = ddp(probe)
            want = reference.master(probe)
        ddp.train()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got_grad_enabled.detach(), want, rtol=RTOL, atol=ATOL)
        assert all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())  # left sharded
        assert not any(c.is_gathered for c in ddp.manager.chunks())
    assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, "end")


@distributed(world_size=2)
def test_zero_gemini_cases_buffers_in_low_precision(rank: int, world_size: int) -> None:
    """A floating buffer computes in the parameters' dtype and is saved in its own (fp32): bf16 reference."""
    reference = Reference(_branch_gpt(), world_size, _adamw, dtype=torch.bfloat16)
    ddp = GeminiDDP(_branch_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.bfloat16)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(2):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
    state = ddp.state_dict(only_rank_0=False)
    assert state["gain"].dtype == torch.float32
    # bf16 Adam at lr 1e-2: a near-zero gradient of different sign after rounding moves a weight 2 * lr apart
    assert_state_close(state, reference.state(), 2e-2, 4e-2, "bf16 with buffers")


class CheckpointedGPT(GPT):
    """Every block under activation checkpointing: its forward runs again (gathering again) during backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(self.pos[: tokens.shape[1]])
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


@distributed(world_size=2)
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_gemini_cases_activation_checkpointing(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    def build() -> CheckpointedGPT:  # non-reentrant (torch's recommended mode; the reference needs autograd.grad)
        torch.manual_seed(0)
        return CheckpointedGPT(reentrant=False)

    reference = Reference(build(), world_size, _adamw)
    ddp = GeminiDDP(build(), chunk_config_dict=config, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")
    assert not any(c.is_gathered and not c.keep_gathered for c in ddp.manager.chunks())


class DataDependentHead(nn.Module):
    """One module whose forward picks one of its two weights from the data: every rank runs it, but a rank may
    produce a gradient for the other weight only."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.w1 = nn.Parameter(torch.randn(64, 16) * 0.1)
        self.w2 = nn.Parameter(torch.randn(64, 16) * 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        weight = self.w1 if int(tokens[0, 0]) % 2 == 0 else self.w2
        out: torch.Tensor = h @ weight.t()
        return out


@distributed(world_size=2)
@pytest.mark.parametrize("async_reduce", [True, False])
def test_zero_gemini_cases_different_gradients_raise_in_backward(
    rank: int, world_size: int, async_reduce: bool
) -> None:
    torch.manual_seed(0)
    ddp = GeminiDDP(DataDependentHead(), mixed_precision=torch.float32, enable_async_reduce=async_reduce)
    tokens = torch.full((1, 4), rank)  # rank 0 takes w1, rank 1 takes w2
    out = ddp(tokens)
    with pytest.raises(PathMismatchError, match=r"given a gradient in backward.*'w1', 'w2'"):
        ddp.backward(out.sum())


@distributed(world_size=2)
@pytest.mark.parametrize("config", CONFIGS)
def test_zero_gemini_cases_replicas_start_identical(rank: int, world_size: int, config: dict[str, int] | None) -> None:
    """Ranks that built the model with different seeds: what every rank keeps in full (buffers, keep_gathered
    chunks) is rank 0's, as with DDP; sharded chunks have one owner per element and stay consistent anyway."""
    torch.manual_seed(rank)
    model = BranchGPT()
    with torch.no_grad():
        model.gain.fill_(float(rank + 1))  # type: ignore[operator]
    ddp = GeminiDDP(model, chunk_config_dict=config, mixed_precision=torch.float32)
    state = ddp.state_dict(only_rank_0=False)
    gathered = [torch.zeros(1) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, state["gain"][:1].clone())
    assert all(float(g) == 1.0 for g in gathered)
    digest = torch.stack([v.float().sum() for v in state.values()])
    everyone = [torch.zeros_like(digest) for _ in range(world_size)]
    torch.distributed.all_gather(everyone, digest)
    assert all(torch.equal(e, everyone[0]) for e in everyone)


@distributed(world_size=2)
def test_zero_gemini_cases_no_deprecated_collectives(rank: int, world_size: int) -> None:
    """cx-zero's gathers in a training step (two path checks) and in the model's and the optimizer's state dicts go
    through cx-mesh's version-tolerant `all_gather_flat`, never torch's old `all_gather_into_tensor`, which torch
    2.13 deprecates with a FutureWarning on every call."""
    original = dist.all_gather_into_tensor
    callers: list[str] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        callers.append(sys._getframe(1).f_code.co_filename)
        return original(*args, **kwargs)

    setattr(dist, "all_gather_into_tensor", recording)  # noqa: B010
    try:
        ddp = GeminiDDP(make_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.bfloat16)
        optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
        x, y = batch(0, world_size)
        optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
        optimizer.step()
        ddp.state_dict(only_rank_0=False)
        optimizer.state_dict(only_rank_0=False)
    finally:
        setattr(dist, "all_gather_into_tensor", original)  # noqa: B010
    assert [c for c in callers if f"{os.sep}cx_zero{os.sep}" in c] == []
