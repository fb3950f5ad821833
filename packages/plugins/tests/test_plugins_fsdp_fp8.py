"""TorchFSDPPlugin's fp8 switches on 2 ranks with a tiny HF Llama (one FSDP module per decoder layer, bf16 params and
bf16 reduction as the baseline): exact bytes of the fp8 all-gather and reduce-scatter against the bf16 run (half, plus 4
bytes a scale), the fp8 linears on exactly the eligible layers, and 32 steps of training within the issue's 3% of the
bf16 run, the parameters after the first step within AdamW's bound of the bf16 run's (fp8_test_helpers; same direction
as bf16 for 97.9% of the elements with fp8_communication, 96.8-97.1% with use_fp8 too, and with torchao; measured, no
floor asserted). On CPU use_fp8 uses cx_mesh.fp8's Fp8Linear; torchao's Float8Linear (what CUDA uses) is forced for two
steps: its weights all-gathered as raw fp8 bytes. The fp8 comm hooks honour FSDP2's async_op."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from cx_mesh.fp8 import Fp8Linear
from cx_mesh.testing import CollectiveBytes, count_collective_bytes, distributed
from cx_plugins import Booster, TorchFSDPPlugin
from cx_plugins.fsdp._fp8 import Fp8AllGather, Fp8ReduceScatter, require_torchao
from fp8_test_helpers import BATCHES, assert_first_step_within_adam, cycled_batch, parameters_now, tiny_llama

STEPS, LR = 32, 3e-3
LOSS_RTOL = 0.03  # the figure for fp8 against bf16 training
# lr 3e-3 (not DDP test's 1e-2): at 1e-2 the fp8-matmul run memorises the four batches faster than bf16 does and the
# two curves drift apart by up to 6% per pass late in the run; at 3e-3 they stay within 1.4% (measured) while the
# loss still falls by ~30%.
SCALE_BYTES = 4
Params = dict[str, torch.Tensor]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # all dims multiples of 16


def _run(
    rank: int, use_fp8: bool = False, fp8_communication: bool = False, torchao: bool = False, steps: int = STEPS
) -> tuple[nn.Module, CollectiveBytes, list[float], tuple[Params, Params]]:
    """Train `steps` steps; returns the model, the bytes of the first step's forward + backward, the mean losses, and
    this rank's parameter shards before and after the first optimizer step."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    plain = tiny_llama()
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    policy = ModuleWrapPolicy({LlamaDecoderLayer})
    plugin = TorchFSDPPlugin(
        auto_wrap_policy=policy, mixed_precision=bf16, use_fp8=use_fp8, fp8_communication=fp8_communication
    )
    if torchao:  # what use_fp8 picks on CUDA
        plugin.options = dataclasses.replace(plugin.options, fp8_linears="torchao")
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    losses, first, start = [], CollectiveBytes(), parameters_now(plain)
    stepped: Params = {}
    for step in range(steps):
        ids = cycled_batch(step, rank)
        with count_collective_bytes() as counts:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
        first = counts if step == 0 else first
        optimizer.step()
        optimizer.zero_grad()
        stepped = parameters_now(plain) if step == 0 else stepped
        mean = loss.detach().float()
        dist.all_reduce(mean)
        losses.append(float(mean.item()) / dist.get_world_size())
    return plain, first, losses, (start, stepped)


def _close_per_pass(name: str, losses: list[float], reference: list[float]) -> None:
    """Compared per pass over the four batches (single steps differ by which batch came last, up to ~5%)."""
    assert reference[-1] < 0.8 * reference[0], (
        f"the tiny model must learn for the comparison to mean anything: {reference}"
    )
    for start in range(0, STEPS, BATCHES):
        mine, theirs = sum(losses[start : start + BATCHES]), sum(reference[start : start + BATCHES])
        assert abs(mine - theirs) <= LOSS_RTOL * theirs, f"{name}, steps {start}+: {losses} vs bf16 {reference}"


def _shard_numel(parameter: nn.Parameter, world_size: int) -> int:
    """Elements of one rank's FSDP2 shard, dim 0 padded to a multiple of the world size."""
    rows = parameter.shape[0]
    return -(-rows // world_size) * (parameter.numel() // rows)


def _groups(model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """The parameters each FSDP module all-gathers (its own, not those of a sharded descendant)."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = {id(p) for m in sharded if m is not model for p in m.parameters()}
    return [[(n, p) for n, p in m.named_parameters() if m is not model or id(p) not in inner] for m in sharded]


def _check_async_hooks(rank: int, world_size: int) -> None:
    """FSDP2's hook contract: async_op gives a Work whose wait leaves exactly the blocking call's values (the
    dequantize runs at the wait, not before); a blocking call returns None, finished."""
    group = dist.group.WORLD
    assert group is not None
    values = torch.linspace(-3.0, 3.0, 48 * world_size, dtype=torch.bfloat16) * (rank + 1)
    shard = values[rank * 48 : (rank + 1) * 48].contiguous()
    hooks = (
        (Fp8AllGather(), lambda hook, out, **kw: hook(out, shard, group, **kw), 48 * world_size),
        (Fp8ReduceScatter(), lambda hook, out, **kw: hook(out, values, group, dist.ReduceOp.SUM, **kw), 48),
    )
    for hook, call, numel in hooks:
        blocking, pending = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
        assert call(hook, blocking) is None
        work = call(hook, pending, async_op=True)
        assert isinstance(work, dist.Work), type(hook).__name__
        work.wait()
        assert blocking.abs().sum() > 0, type(hook).__name__
        assert torch.equal(pending, blocking), type(hook).__name__


@distributed(world_size=2)
def test_fsdp_fp8_communication_and_use_fp8(rank: int, world_size: int) -> None:
    _check_async_hooks(rank, world_size)
    # As every plugin's use_fp8: a model with nothing to convert says so rather than silently training in bf16.
    with pytest.warns(UserWarning, match=r"TorchFSDPPlugin\(use_fp8=True\): no layer was converted"):
        Booster(plugin=TorchFSDPPlugin(use_fp8=True)).boost(nn.Sequential(nn.Linear(8, 8)))
    _, bf16_bytes, bf16_losses, (start, bf16_first) = _run(rank)
    model, comm_bytes, comm_losses, (_, comm_first) = _run(rank, fp8_communication=True)
    assert_first_step_within_adam(start, bf16_first, comm_first, LR)
    groups = len(_groups(model))  # 2 decoder layers and the root
    # FULL_SHARD: every module is gathered for forward and again for backward; its gradients reduce-scattered once.
    assert set(comm_bytes.by_op) == {"all_gather_single", "all_to_all_single"}, comm_bytes.by_op
    assert (
        comm_bytes.by_op["all_gather_single"] == bf16_bytes.by_op["all_gather_single"] // 2 + SCALE_BYTES * 2 * groups
    )
    # on gloo the bf16 run reduce-scatters by an in-place all-reduce of the same input (cx_plugins.fsdp._gloo_comms)
    assert comm_bytes.by_op["all_to_all_single"] == (
        bf16_bytes.by_op["all_reduce"] // 2 + SCALE_BYTES * world_size * groups
    )
    _close_per_pass("fp8_communication", comm_losses, bf16_losses)

    model, fp8_bytes, fp8_losses, (_, fp8_first) = _run(rank, use_fp8=True, fp8_communication=True)
    assert_first_step_within_adam(start, bf16_first, fp8_first, LR)
    attention, mlp = LINEARS[:4], LINEARS[4:]
    eligible = [f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in attention]
    eligible += [f"model.layers.{i}.mlp.{n}" for i in range(2) for n in mlp]
    # every eligible linear; lm_head (excluded) stays in high precision
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Fp8Linear)) == sorted(eligible)
    assert fp8_bytes.by_op == comm_bytes.by_op  # the same parameters and gradients through the same fp8 collectives
    _close_per_pass("use_fp8 + fp8_communication", fp8_losses, bf16_losses)

    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao (the fp8 extra) is not installed: its Float8Linear path (CUDA's) not tested")
    saved = sys.modules.get("torchao.float8")
    sys.modules["torchao.float8"] = None  # type: ignore[assignment]  # as if torchao were missing: imports fail
    try:
        with pytest.raises(ImportError, match=r"use_fp8=True.*fp8 extra.*cx-plugins\[fp8\]"):
            require_torchao()
    finally:
        if saved is None:
            del sys.modules["torchao.float8"]
        else:
            sys.modules["torchao.float8"] = saved

    # through importlib: torchao is an optional extra, absent from the typecheck venv
    float8_linear = importlib.import_module("torchao.float8.float8_linear").Float8Linear

    model, ao_bytes, ao_losses, (_, ao_first) = _run(rank, use_fp8=True, fp8_communication=True, torchao=True, steps=2)
    assert_first_step_within_adam(start, bf16_first, ao_first, LR)
    assert sorted(n for n, m in model.named_modules() if isinstance(m, float8_linear)) == sorted(eligible)
    assert abs(ao_losses[1] - bf16_losses[1]) <= LOSS_RTOL * bf16_losses[1]
    # A decoder layer's shards go as torchao packs them (fp8 weights, bf16 norms, no scale: torchao agrees on it
    # with its own amax all-reduce); the root (embedding, final norm, lm_head) through cx's fp8 all-gather.
    expected = 0
    for group in _groups(model):
        fp8 = sum(_shard_numel(p, world_size) for n, p in group if n.split(".")[-2] in LINEARS)
        if fp8:
            rest = sum(_shard_numel(p, world_size) for n, p in group if n.split(".")[-2] not in LINEARS)
            expected += 2 * (fp8 + 2 * rest)
        else:
            expected += 2 * (sum(_shard_numel(p, world_size) for _, p in group) + SCALE_BYTES)
    assert ao_bytes.by_op["all_gather_single"] == expected
    assert ao_bytes.by_op["all_to_all_single"] == comm_bytes.by_op["all_to_all_single"]  # same gradients, same bytes
