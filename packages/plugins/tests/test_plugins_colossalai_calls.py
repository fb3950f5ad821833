"""Calls ColossalAI scripts make on boosted objects, the way they make them: parameter counting after a Gemini
boost, `model.state_dict(only_rank_0=...)`, `optimizer.backward_by_grad`, the ZeRO master maps and
`update_master_params`, each checked against plain PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cx_mesh.testing import TEST_ADAM_EPS, distributed
from cx_plugins import Booster, HybridParallelPlugin, ModelWrapper
from cx_plugins.gemini._plugin import GeminiModel
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer
from cx_plugins.models import GPT
from cx_plugins.wrappers._zero import ZeroOptimizerWrapper
from plugins_test_helpers import ATOL, CONFIG, GLOBAL_BATCH, RTOL, data, make_plugin, reference


@distributed(world_size=2)
def test_gemini_parameters_keep_their_shape_and_state_dict_takes_only_rank_0(rank: int, world_size: int) -> None:
    plain = GPT(CONFIG, seed=0)
    shapes = {n: p.shape for n, p in plain.named_parameters()}
    count = sum(p.numel() for p in plain.parameters())
    booster = Booster(plugin=make_plugin("gemini"))
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    assert isinstance(model, GeminiModel)
    # ColossalAI's scripts count parameters after boost (TFLOPS lines, size_per_shard arithmetic)
    assert sum(p.numel() for p in model.parameters()) == count
    assert {n: p.shape for n, p in model.unwrap().named_parameters()} == shapes
    batches = data(2)
    per_rank = GLOBAL_BATCH // world_size
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(model(mine, labels=mine), optimizer)
        optimizer.step()
        optimizer.zero_grad()
    assert sum(p.numel() for p in model.parameters()) == count  # still, after training released the chunks
    expected = reference(batches).state_dict()
    everywhere = model.state_dict(only_rank_0=False)
    for name, value in expected.items():
        torch.testing.assert_close(everywhere[name].float(), value, rtol=RTOL, atol=ATOL, msg=name)
    on_rank_0 = model.state_dict(only_rank_0=True)
    assert (set(on_rank_0) == set(expected)) if rank == 0 else on_rank_0 == {}
    model.load_state_dict(GPT(CONFIG, seed=3).state_dict())  # full tensors in, each rank keeps its part
    for name, value in GPT(CONFIG, seed=3).state_dict().items():
        torch.testing.assert_close(model.state_dict(only_rank_0=False)[name], value, msg=name)
    with pytest.raises(NotImplementedError, match="backward_by_grad"):
        optimizer.backward_by_grad(torch.ones(1, requires_grad=True), torch.ones(1))


@distributed(world_size=2)
@pytest.mark.parametrize("plugin", ["torch_ddp", "zero1", "zero2"])
def test_backward_by_grad_trains_like_backward(rank: int, world_size: int, plugin: str) -> None:
    booster = Booster(plugin=make_plugin(plugin))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    assert isinstance(model, ModelWrapper)
    batches = data(2)
    per_rank = GLOBAL_BATCH // world_size
    for batch in batches:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(mine, labels=mine)
        optimizer.backward_by_grad(loss, torch.ones_like(loss))  # d(loss)/d(loss) = 1: the same as backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    expected = reference(batches).state_dict()
    state = model.unwrap().state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(state[name].float(), value, rtol=RTOL, atol=ATOL, msg=name)


@distributed(world_size=2)
def test_zero_master_maps_and_update_master_params(rank: int, world_size: int) -> None:
    booster = Booster(plugin=make_plugin("zero2"))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=0.0))
    assert isinstance(optimizer, ZeroOptimizerWrapper)
    assert isinstance(model, ModelWrapper)
    working_to_master = optimizer.get_working_to_master_map()
    master_to_working = optimizer.get_master_to_working_map()
    assert len(working_to_master) == len(list(plain.parameters())) == len(master_to_working)
    padding = optimizer.zero.get_param_padding_map()
    for name, working in model.unwrap().named_parameters():
        master = working_to_master[id(working)]
        assert master_to_working[id(master)] is working, name  # the two maps are inverses
        assert master.dtype == torch.float32, name
        # this rank's shard of the flattened, padded parameter, holding its values
        flat = torch.nn.functional.pad(working.detach().flatten().float(), [0, padding[id(working)]])
        torch.testing.assert_close(master.flatten(), flat.chunk(world_size)[rank], rtol=0, atol=0, msg=name)
    # load other weights into the model, then tell the optimizer: its masters (and so the next step) follow
    replacement = GPT(CONFIG, seed=7)
    model.unwrap().load_state_dict(replacement.state_dict())
    optimizer.update_master_params(model)
    mine = data(1)[0][rank * 2 : rank * 2 + 2]
    booster.backward(model(mine, labels=mine), optimizer)
    optimizer.step()
    for name, value in replacement.state_dict().items():  # lr 0: the step writes the masters back unchanged
        torch.testing.assert_close(model.unwrap().state_dict()[name], value, msg=name)


@distributed(world_size=2)
def test_hybrid_master_maps_are_inverse(rank: int, world_size: int) -> None:
    # HybridParallelPlugin at zero_stage 0 in bf16: fp32 master copies of the bf16 working parameters
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=1, precision="bf16", zero_stage=0))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=0.0))
    assert isinstance(optimizer, HybridParallelOptimizer)
    assert isinstance(model, ModelWrapper)
    working_to_master = optimizer.get_working_to_master_map()
    master_to_working = optimizer.get_master_to_working_map()
    named = list(model.unwrap().named_parameters())
    assert len(working_to_master) == len(master_to_working) == len(named)
    for name, working in named:
        master = working_to_master[id(working)]
        assert master_to_working[id(master)] is working, name
        assert master is not working, name
        assert (working.dtype, master.dtype) == (torch.bfloat16, torch.float32), name
        assert master.shape == working.shape, name
        torch.testing.assert_close(master.to(torch.bfloat16), working.detach(), rtol=0, atol=0, msg=name)


@distributed(world_size=2)
def test_checkpoint_calls_in_colossalai_argument_order(rank: int, world_size: int, tmp_path: Path) -> None:
    booster = Booster(plugin=make_plugin("zero2"))
    plain = GPT(CONFIG, seed=0)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    mine = data(1)[0][rank * 2 : rank * 2 + 2]
    booster.backward(model(mine, labels=mine), optimizer)
    optimizer.step()
    directory = tmp_path
    booster.save_model(model, directory / "model", True, True, None, 1024, True)  # ColossalAI's positional order
    booster.save_optimizer(optimizer, directory / "optimizer", True, True, None, 1024)
    booster.checkpoint_io._sync_io()
    plain2 = GPT(CONFIG, seed=4)
    booster2 = Booster(plugin=make_plugin("zero2"))
    model2, optimizer2, *_ = booster2.boost(plain2, torch.optim.AdamW(plain2.parameters(), lr=1e-2, eps=TEST_ADAM_EPS))
    assert optimizer2 is not None
    assert isinstance(model, ModelWrapper)
    assert isinstance(model2, ModelWrapper)
    booster2.load_model(model2, directory / "model", True, True, 1)  # strict, low_cpu_mem_mode, num_threads
    booster2.load_optimizer(optimizer2, directory / "optimizer", None, True, 1)  # prefix, low_cpu_mem_mode, threads
    for name, value in model.unwrap().state_dict().items():
        torch.testing.assert_close(model2.unwrap().state_dict()[name], value, msg=name)
    assert optimizer2.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()
    # ColossalAI's booster checkpoint tests: `save_model(model, f"{tempdir}/model", shard=False)`, no suffix
    for name, use_safetensors in (("model_file", False), ("model_file_st", True)):
        booster.save_model(model, directory / name, shard=False, use_safetensors=use_safetensors)
        with torch.no_grad():
            for parameter in model2.unwrap().parameters():
                parameter.add_(1.0)
        booster2.load_model(model2, directory / name)
        for key, value in model.unwrap().state_dict().items():
            torch.testing.assert_close(model2.unwrap().state_dict()[key], value, rtol=0, atol=0, msg=key)
