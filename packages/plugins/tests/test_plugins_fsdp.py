"""TorchFSDPPlugin (ColossalAI's FSDP1 arguments on torch's FSDP2) against single-process training: fp32 and bf16
parity with the optimizer's param groups kept, no_sync accumulation, canonical checkpoints that resume exactly and
load into a plain model, and clear errors for what FSDP2 cannot express."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from cx_checkpoint import GeneralCheckpointIO
from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, ModelWrapper, OptimizerWrapper, TorchFSDPPlugin
from cx_plugins.models import GPT
from plugins_test_helpers import ATOL, CONFIG, GLOBAL_BATCH, LR, RTOL, data

STEPS = 3


def _groups(model: nn.Module) -> list[dict[str, object]]:
    """Two param groups (no weight decay on norms and biases): ColossalAI's FSDP plugin would merge them."""
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _plugin(**options: object) -> TorchFSDPPlugin:
    block = type(GPT(CONFIG, seed=0).blocks[0])
    return TorchFSDPPlugin(auto_wrap_policy=ModuleWrapPolicy({block}), **options)  # type: ignore[arg-type]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    module = model.unwrap() if isinstance(model, ModelWrapper) else model
    return {
        n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().float() for n, t in module.state_dict().items()
    }


def _reference(batches: torch.Tensor, world_size: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Single-process data parallelism: each rank's micro-batch through a `dtype` copy of the weights, fp32 gradients
    averaged over ranks, AdamW on the fp32 weights."""
    model = GPT(CONFIG, seed=0)
    optimizer = torch.optim.AdamW(_groups(model), lr=LR, eps=TEST_ADAM_EPS)
    per_rank = GLOBAL_BATCH // world_size
    for batch in batches:
        grads: dict[str, torch.Tensor] = {}
        for micro in batch.split(per_rank):
            compute = copy.deepcopy(model).to(dtype)
            compute(micro, labels=micro).backward()
            for name, param in compute.named_parameters():
                assert param.grad is not None
                grads[name] = grads.get(name, 0) + param.grad.float() / world_size
        for name, param in model.named_parameters():
            param.grad = grads[name]
        optimizer.step()
        optimizer.zero_grad()
    return model


def _train(
    rank: int, world_size: int, booster: Booster, model: nn.Module, optimizer: OptimizerWrapper, batches: torch.Tensor
) -> None:
    per_rank = GLOBAL_BATCH // world_size
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(model(mine, labels=mine), optimizer)
        optimizer.step()
        optimizer.zero_grad()


def _boost(plugin: TorchFSDPPlugin) -> tuple[Booster, nn.Module, OptimizerWrapper]:
    booster = Booster(plugin=plugin)
    model = GPT(CONFIG, seed=0)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(_groups(model), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    return booster, boosted, optimizer


def _assert_close(state: dict[str, torch.Tensor], expected: nn.Module, rtol: float, atol: float) -> None:
    want = expected.state_dict()
    assert set(state) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=rtol, atol=atol, msg=name)


@distributed(world_size=2)
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP])
def test_fsdp_fp32_matches_single_process_with_param_groups_kept(
    rank: int, world_size: int, strategy: ShardingStrategy
) -> None:
    booster, model, optimizer = _boost(_plugin(sharding_strategy=strategy))
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(isinstance(p, DTensor) for p in model.parameters())  # really sharded
    batches = data(STEPS)
    _train(rank, world_size, booster, model, optimizer, batches)
    _assert_close(_full(model), _reference(batches, world_size), RTOL, ATOL)


@distributed(world_size=2)
def test_fsdp_bf16_mixed_precision_matches_its_reference(rank: int, world_size: int) -> None:
    mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    booster, model, optimizer = _boost(_plugin(mixed_precision=mixed, backward_prefetch=BackwardPrefetch.BACKWARD_PRE))
    batches = data(STEPS)
    _train(rank, world_size, booster, model, optimizer, batches)
    # same bf16 compute and fp32 masters as the reference: differences are the reduction order in fp32
    _assert_close(_full(model), _reference(batches, world_size, torch.bfloat16), 1e-4, LR / 50)


@distributed(world_size=2)
def test_fsdp_no_sync_accumulates_like_one_large_batch(rank: int, world_size: int) -> None:
    booster, model, optimizer = _boost(_plugin())
    batches = data(2)  # two halves of one global batch: the first accumulated without communication
    per_rank = GLOBAL_BATCH // world_size
    for index, batch in enumerate(batches):
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        if index == 0:
            with booster.no_sync(model, optimizer):
                booster.backward(model(mine, labels=mine) / 2, optimizer)
        else:
            booster.backward(model(mine, labels=mine) / 2, optimizer)
    optimizer.step()
    expected = GPT(CONFIG, seed=0)
    reference_optimizer = torch.optim.AdamW(_groups(expected), lr=LR, eps=TEST_ADAM_EPS)
    for batch in batches:
        (expected(batch, labels=batch) / 2).backward()
    reference_optimizer.step()
    _assert_close(_full(model), expected, RTOL, ATOL)


@distributed(world_size=2)
@pytest.mark.parametrize("shard", [True, False])
def test_fsdp_checkpoint_resumes_exactly_and_loads_into_a_plain_model(
    rank: int, world_size: int, shard: bool, tmp_path: Path
) -> None:
    batches = data(4)
    booster, model, optimizer = _boost(_plugin())
    _train(rank, world_size, booster, model, optimizer, batches[:2])
    model_path = tmp_path / ("model" if shard else "model.safetensors")
    optimizer_path = tmp_path / ("optimizer" if shard else "optimizer.safetensors")
    sizes = {"size_per_shard": 0.01} if shard else {}  # several shard files for the tiny model
    booster.save_model(model, model_path, shard=shard, use_safetensors=True, **sizes)  # type: ignore[arg-type]
    booster.save_optimizer(optimizer, optimizer_path, shard=shard, **sizes)  # type: ignore[arg-type]
    _train(rank, world_size, booster, model, optimizer, batches[2:])
    uninterrupted = _full(model)

    booster, resumed, resumed_optimizer = _boost(_plugin())
    booster.load_model(resumed, model_path)
    booster.load_optimizer(resumed_optimizer, optimizer_path)
    _train(rank, world_size, booster, resumed, resumed_optimizer, batches[2:])
    for name, value in _full(resumed).items():
        torch.testing.assert_close(value, uninterrupted[name], rtol=0, atol=0, msg=name)

    plain = GPT(CONFIG, seed=1)  # another initialisation: the checkpoint must overwrite every tensor
    GeneralCheckpointIO().load_model(plain, model_path)
    reference = _reference(batches[:2], world_size)
    _assert_close({n: t.float() for n, t in plain.state_dict().items()}, reference, RTOL, ATOL)


@distributed(world_size=2)
def test_fsdp_cpu_offload_trains_like_single_process(rank: int, world_size: int) -> None:
    booster, model, optimizer = _boost(_plugin(cpu_offload=CPUOffload(offload_params=True)))
    batches = data(2)
    _train(rank, world_size, booster, model, optimizer, batches)
    _assert_close(_full(model), _reference(batches, world_size), RTOL, ATOL)


@distributed(world_size=1)
def test_fsdp_arguments_fsdp2_cannot_express_are_clear_errors(rank: int, world_size: int) -> None:
    with pytest.raises(NotImplementedError, match=r"NO_SHARD\) is plain data parallelism: use TorchDDPPlugin"):
        TorchFSDPPlugin(sharding_strategy=ShardingStrategy.NO_SHARD)
    with pytest.raises(NotImplementedError, match="HYBRID_SHARD"):
        TorchFSDPPlugin(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(NotImplementedError, match="param_init_fn"):
        TorchFSDPPlugin(param_init_fn=lambda module: None)
    with pytest.raises(NotImplementedError, match="float16 mixed precision"):
        TorchFSDPPlugin(mixed_precision=MixedPrecision(param_dtype=torch.float16))
    with pytest.warns(UserWarning, match="BACKWARD_POST"):
        TorchFSDPPlugin(backward_prefetch=BackwardPrefetch.BACKWARD_POST)


@distributed(world_size=2)
def test_fsdp_clip_grad_by_norm_uses_the_global_norm(rank: int, world_size: int) -> None:
    booster = Booster(plugin=_plugin())
    model = GPT(CONFIG, seed=0)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert optimizer is not None
    expected = GPT(CONFIG, seed=0)
    reference_optimizer = torch.optim.SGD(expected.parameters(), lr=LR)
    batches = data(2)
    per_rank = GLOBAL_BATCH // world_size
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(boosted(mine, labels=mine), optimizer)
        norm = optimizer.clip_grad_by_norm(0.05)  # well below the gradients' norm: clipping really acts
        optimizer.step()
        optimizer.zero_grad()
        expected(batch, labels=batch).backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.05)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        assert not isinstance(norm, DTensor)
        torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0)
        assert float(norm) > 0.05
    _assert_close(_full(boosted), expected, RTOL, 1e-6)
