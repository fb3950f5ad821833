"""Placement: static fractions, optimizer / parameter offload, auto with a device budget, prefetch; memory accounting.

Every placement must train exactly like PyTorch (fp32, 1e-5 relative): placement moves bytes, never changes values.
"""

from __future__ import annotations

import pytest
import torch

from cx_chunk import AutoPlacementPolicy, MemStats, Residence
from cx_mesh import get_accelerator
from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import GPT, Reference, assert_state_close, batch, lm_loss, local, make_gpt, train_step

RTOL, ATOL = 1e-5, 1e-6
CHUNK = {"chunk_size": 2048}


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _train(
    rank: int,
    world_size: int,
    steps: int,
    dtype: torch.dtype = torch.float32,
    gpu_margin_mem_ratio: float = 0.0,
    **kwargs: object,
) -> GeminiDDP:
    reference = Reference(make_gpt(), world_size, _adamw, dtype=dtype)
    ddp = GeminiDDP(make_gpt(), chunk_config_dict=CHUNK, mixed_precision=dtype, **kwargs)  # type: ignore[arg-type]
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp, gpu_margin_mem_ratio=gpu_margin_mem_ratio)
    ddp.test_optimizer = optimizer  # type: ignore[assignment]
    for step in range(steps):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
        if dtype == torch.float32:
            assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")
        else:  # bf16: Adam moves a weight by about +-lr per step, so a near-zero gradient whose sign differs
            # after bf16 rounding of the reduction moves it the other way: up to 2 * lr = 2e-2 apart
            assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), 2e-2, 2e-2, f"step {step}")
    return ddp


@distributed(world_size=2)
@pytest.mark.parametrize("shard_param_frac", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("offload_optim_frac", [0.0, 1.0])
def test_zero_gemini_placement_static(
    rank: int, world_size: int, shard_param_frac: float, offload_optim_frac: float
) -> None:
    ddp = _train(rank, world_size, 3, shard_param_frac=shard_param_frac, offload_optim_frac=offload_optim_frac)
    chunks = ddp.manager.chunks("param")
    kept = [c for c in chunks if c.is_gathered]
    if shard_param_frac == 1.0:
        assert not kept
    if shard_param_frac == 0.0:
        assert len(kept) == len(chunks)
    if shard_param_frac == 0.5:
        assert 0 < len(kept) < len(chunks)
    for chunk in chunks:
        want = Residence.HOST if offload_optim_frac == 1.0 else Residence.DEVICE
        assert ddp.manager.grad_chunk(chunk).residence is want


@distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gemini_placement_offload_params(rank: int, world_size: int, dtype: torch.dtype) -> None:
    ddp = _train(rank, world_size, 3, dtype, offload_param_frac=1.0, offload_optim_frac=1.0, shard_param_frac=1.0)
    assert all(c.residence is Residence.HOST for c in ddp.manager.chunks("param"))
    assert ddp.manager.usage.device == 0  # at rest everything lives on the host


@distributed(world_size=2)
@pytest.mark.parametrize("max_prefetch", [0, 2])
def test_zero_gemini_placement_prefetch(rank: int, world_size: int, max_prefetch: int) -> None:
    ddp = _train(rank, world_size, 3, max_prefetch=max_prefetch)
    assert bool(ddp.scheduler.prefetch_log) == (max_prefetch > 0)
    assert not any(c.is_gathered for c in ddp.manager.chunks())  # prefetched chunks were released too


@distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gemini_placement_auto_with_budget(rank: int, world_size: int, dtype: torch.dtype) -> None:
    accelerator = get_accelerator()
    accelerator.set_memory_capacity(60_000)
    try:
        ddp = _train(rank, world_size, 3, dtype, placement_policy="auto")
    finally:
        accelerator.set_memory_capacity(None)
    policy = ddp.policy
    assert isinstance(policy, AutoPlacementPolicy)
    assert policy.evictions, "a 12 kB warm-up budget must evict chunks"
    assert all(record.device_bytes <= 60_000 * 0.9 for record in policy.budget_log)


@distributed(world_size=(2, 4))
def test_zero_gemini_placement_memory_is_one_over_n(rank: int, world_size: int) -> None:
    ddp = _train(rank, world_size, 1, torch.bfloat16)
    chunks = ddp.manager.chunks()
    gathered = sum(c.nbytes for c in chunks)
    # released bf16 chunks keep no slice of their own: their values are the fp32 master's, cast when gathered
    resident = sum(c.memory_usage().device + c.memory_usage().host for c in chunks)
    assert resident == 0
    assert not any(c.has_own_slice for c in chunks)
    masters = sum(ddp.manager.master_chunk(c).memory_usage().device for c in ddp.manager.chunks("param"))
    assert masters == 2 * gathered // world_size  # fp32 master slices: twice the bf16 bytes, 1/N
    grads = sum(ddp.manager.grad_chunk(c).memory_usage().device for c in ddp.manager.chunks("param"))
    assert grads == 0  # freed by zero_grad at the end of the step; the next backward makes them again
    assert all(p.untyped_storage().nbytes() == 0 for p in ddp.parameters())  # released: no storage, shape kept
    assert ddp.manager.recount() == ddp.manager.usage
    report = ddp.chunk_memory()
    assert report["gathered_param_bytes"] == gathered
    assert report["device"] + report["host"] == ddp.manager.usage.device + ddp.manager.usage.host
    assert isinstance(ddp.unwrap(), GPT)


@distributed(world_size=2)
def test_zero_gemini_placement_memstats_replaces_warmup(rank: int, world_size: int) -> None:
    """A MemStats recorded before training (here: one period per block, in forward order) is the trace from the
    first step on: prefetching starts in step 0, and training still matches PyTorch."""
    model = make_gpt()
    memstats = MemStats()
    for module in [model.wte, *model.h, model.ln_f]:
        memstats.record_period(list(module.parameters()), non_model_bytes=0)
    reference = Reference(make_gpt(), world_size, _adamw)
    ddp = GeminiDDP(model, chunk_config_dict=CHUNK, mixed_precision=torch.float32, memstats=memstats, max_prefetch=2)
    assert ddp.scheduler.warmed_up
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    x, y = batch(0, world_size)
    optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
    optimizer.step()
    reference.step(0)
    assert ddp.scheduler.prefetch_log  # prefetched during the very first step
    assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, "step 0")


COMBINATIONS = [
    {"placement_policy": "auto", "max_prefetch": 2},
    {"offload_param_frac": 1.0, "offload_optim_frac": 1.0, "max_prefetch": 2},
    {"shard_param_frac": 0.5, "offload_optim_frac": 1.0, "max_prefetch": 2, "enable_async_reduce": False},
]


@distributed(world_size=4)
@pytest.mark.parametrize("kwargs", COMBINATIONS, ids=["auto-prefetch", "offload-all-prefetch", "half-kept-offload"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gemini_placement_combinations(
    rank: int, world_size: int, kwargs: dict[str, object], dtype: torch.dtype
) -> None:
    accelerator = get_accelerator()
    accelerator.set_memory_capacity(60_000)
    try:
        _train(rank, world_size, 3, dtype, **kwargs)  # type: ignore[arg-type]
    finally:
        accelerator.set_memory_capacity(None)


@distributed(world_size=(2, 4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gemini_placement_backward_needs_one_buffer_per_chunk(
    rank: int, world_size: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = GPT(layers=4)
    root = {id(p) for p in [*model.wte.parameters(), *model.wpe.parameters(), *model.ln_f.parameters()]}
    ddp = GeminiDDP(model, chunk_config_dict=CHUNK, mixed_precision=dtype)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    chunks = ddp.manager.chunks("param")
    # the root unit's parameters stay gathered through the whole step, and so do a block's layer norms through
    # the block (here more than a chunk's worth of attention and MLP weights): they share no chunk with those
    for chunk in chunks:
        names = [slot.name for slot in chunk.slots]
        if {id(t) for t in chunk.tensors} & root:
            assert not [n for n in names if ".attn." in n or ".mlp." in n], names
    separate_buffers: list[torch.Tensor] = []
    manager = ddp.manager
    original = manager.accumulate_grad

    def counting(tensor: torch.Tensor, grad: torch.Tensor) -> None:
        separate_buffers.append(tensor)
        original(tensor, grad)

    manager.accumulate_grad = counting  # type: ignore[method-assign]
    for step in range(2):
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        rest = manager.usage.device
        manager.reset_peak()
        optimizer.backward(lm_loss(ddp(local(x, rank, world_size)), local(y, rank, world_size)))
        optimizer.step()
    assert not separate_buffers  # every gradient went into its gathered parameter chunk
    assert manager.collective_counts["reduce_scatter"] == 2 * len(chunks)
    # in flight at most: the root chunk, the chunk whose reduce-scatter overlaps backward (with its output slice),
    # the chunk in backward, the next one being gathered (and the own slices of values kept aside in fp32, where
    # no master holds them)
    full = max(c.nbytes for c in chunks)
    root_bytes = sum(c.nbytes for c in chunks if {id(t) for t in c.tensors} & root)
    aside = 0 if dtype != torch.float32 else 3 * full // world_size
    grads = sum(c.shard_nbytes for c in chunks)  # gradient slices: freed by zero_grad, created by the reductions
    bound = grads + root_bytes + 3 * full + full // world_size + aside
    assert manager.peak.device - rest <= bound, (manager.peak.device - rest, full, root_bytes)
    assert not manager.reducing
    assert manager.usage.device == rest  # after step (zero_grad): the gradient slices are gone again


@distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [1.0, 4e-5])
def test_zero_gemini_placement_gpu_margin_moves_optimizer_data(
    rank: int, world_size: int, dtype: torch.dtype, ratio: float
) -> None:
    accelerator = get_accelerator()
    accelerator.set_memory_capacity(10**9)
    try:  # parity with PyTorch at every step is checked inside _train: placement never changes values
        ddp = _train(rank, world_size, 3, dtype, ratio, placement_policy="auto")
    finally:
        accelerator.set_memory_capacity(None)
    optimizer: GeminiOptimizer = ddp.test_optimizer  # type: ignore[assignment]
    policy = ddp.policy
    assert isinstance(policy, AutoPlacementPolicy)
    chunks = ddp.manager.chunks("param")
    moved = optimizer.device_optimizer_chunks
    assert moved is not None
    if ratio == 1.0:  # a 1 GB device holds everything
        assert moved == chunks
    else:  # about 36 kB: the first few chunks (layout order), not all
        assert 0 < len(moved) < len(chunks)
        assert moved == chunks[: len(moved)]
    state_bytes = 0
    for chunk in chunks:
        on_device = chunk in moved
        want = Residence.DEVICE if on_device else Residence.HOST
        assert policy.optimizer_residence(chunk) is want
        assert all(c.residence is want for c in ddp.manager.companions(chunk))
    moved_holders = {id(e.holder) for e in optimizer._entries if e.chunk in moved}
    for holder, state in optimizer.optim.state.items():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and id(holder) in moved_holders:
                state_bytes += value.numel() * value.element_size()
    assert policy.reserved_bytes == state_bytes  # taken off the auto policy's later budgets


@distributed(world_size=2)
def test_zero_gemini_placement_gpu_margin_needs_auto(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(make_gpt(), chunk_config_dict=CHUNK, mixed_precision=torch.float32)
    with pytest.raises(ValueError, match="placement_policy='auto' only"):
        GeminiOptimizer(_adamw(list(ddp.parameters())), ddp, gpu_margin_mem_ratio=0.5)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        GeminiOptimizer(_adamw(list(ddp.parameters())), ddp, gpu_margin_mem_ratio=1.5)


@distributed(world_size=2)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_gemini_placement_forward_frees_what_autograd_saved(
    rank: int, world_size: int, dtype: torch.dtype
) -> None:
    # autograd saves the parameters each layer read; a chunk released after its layer must free its buffer anyway
    # (FSDP2's storage resize), or every chunk stays allocated until backward while the accounting says released
    torch.manual_seed(0)
    ddp = GeminiDDP(GPT(layers=4), chunk_config_dict=CHUNK, mixed_precision=dtype)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    params = {id(p) for p in ddp.parameters()}
    saved: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) in params:  # keyed by the storage's address when it was saved
            saved.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage())
        return tensor

    for step in range(2):
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = ddp(local(x, rank, world_size))
        held = sum(storage.nbytes() for storage in saved.values())
        gathered = sum(c.nbytes for c in ddp.manager.chunks() if c.is_gathered)
        all_chunks = sum(c.nbytes for c in ddp.manager.chunks())
        assert saved, "the forward saved no parameter: the test checks nothing"
        assert held <= gathered < all_chunks, (held, gathered, all_chunks)
        optimizer.backward(lm_loss(logits, local(y, rank, world_size)))  # the same storage, refilled
        optimizer.step()
        saved.clear()
