"""HybridCheckpointIO: TP shards and pipeline stages gathered into the canonical cx format, checked against a
single-process AdamW run. Saved at tp2 (2 ranks) and tp2 x pp2 (4 ranks); loaded at other tp / pp / dp layouts, by
transformers `from_pretrained`, and by GeneralCheckpointIO into a plain model; each resumed run continues to the
uninterrupted run's parameters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import CheckpointError, CheckpointKind, CheckpointReader, GeneralCheckpointIO
from cx_mesh.testing import run_distributed
from cx_plugins import Booster, GeminiPlugin
from cx_plugins.gemini._plugin import GeminiModel
from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from hybrid_ckpt_helpers import (
    BATCH,
    LR,
    as_optimizer,
    assert_matches,
    assert_same_state,
    batches,
    build,
    compose,
    full_params,
    paths,
    reference,
    reference_with_optimizer,
    train,
)

transformers = pytest.importorskip("transformers")

BEFORE, AFTER = 2, 2


def _save(rank: int, world_size: int, kind: str, tp: int, pp: int, optimizer: str, directory: str) -> None:
    view, face, io = compose(kind, tp, pp, optimizer)
    train(view, face, batches(BEFORE + AFTER)[:BEFORE])
    assert_matches(full_params(view), reference(kind, batches(BEFORE)), f"{kind} trained at tp{tp} pp{pp}")
    for shard in (True, False):
        model_path, optimizer_path = paths(directory, shard)
        io.save_model(view, model_path, shard=shard, use_safetensors=True, size_per_shard=0.002)
        io.save_optimizer(as_optimizer(face), optimizer_path, shard=shard, size_per_shard=0.002)
    dist.barrier()


def _resume(
    rank: int, world_size: int, kind: str, tp: int, pp: int, optimizer: str, directory: str, shard: bool
) -> None:
    view, face, io = compose(kind, tp, pp, optimizer, seed=1)  # another init: only the checkpoint can fix it
    model_path, optimizer_path = paths(directory, shard)
    io.load_model(view, model_path)
    io.load_optimizer(as_optimizer(face), optimizer_path)
    data = batches(BEFORE + AFTER)
    train(view, face, data[BEFORE:])
    assert_matches(full_params(view), reference(kind, data), f"{kind} resumed at tp{tp} pp{pp} ({optimizer})")
    dist.barrier()


def _check_plain(kind: str, directory: str, shard: bool) -> None:
    """A single process: transformers loads the weights; GeneralCheckpointIO loads weights and optimizer into a plain
    model and AdamW, which continue to the uninterrupted run."""
    model_path, optimizer_path = paths(directory, shard)
    expected, expected_optimizer = reference_with_optimizer(kind, batches(BEFORE))
    if shard:
        assert (model_path / "config.json").is_file()
        index = json.loads((model_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1  # several shards (written by several ranks)
        model_class: Any = type(expected)
        loaded = model_class.from_pretrained(model_path)
        assert_matches(dict(loaded.named_parameters()), expected, f"{kind} from_pretrained")
    plain = build(kind, seed=1)
    optim = torch.optim.AdamW(plain.named_parameters(), lr=LR)
    io = GeneralCheckpointIO()
    io.load_model(plain, model_path)
    io.load_optimizer(optim, optimizer_path)
    assert_matches(dict(plain.named_parameters()), expected, f"{kind} loaded by GeneralCheckpointIO")
    assert_same_state(optim, expected_optimizer, f"{kind} optimizer state loaded by GeneralCheckpointIO")
    for batch in batches(BEFORE + AFTER)[BEFORE:]:
        plain(input_ids=batch, labels=batch).loss.backward()
        optim.step()
        optim.zero_grad()
    assert_matches(dict(plain.named_parameters()), reference(kind, batches(BEFORE + AFTER)), f"{kind} plain resume")


def _resume_in_gemini(rank: int, world_size: int, directory: str) -> None:
    """The hybrid checkpoint in another plugin: GeminiPlugin (ZeRO-3 over 2 ranks) continues to the reference."""
    plugin = GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 1024})
    booster = Booster(plugin=plugin)
    plain = build("llama", seed=1)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR))
    assert optimizer is not None
    model_path, optimizer_path = paths(directory, True)
    booster.load_model(model, model_path)
    booster.load_optimizer(optimizer, optimizer_path)
    data_rank, data_size = plugin.layout.data_rank_and_size()
    per_rank = BATCH // data_size
    data = batches(BEFORE + AFTER)
    for batch in data[BEFORE:]:
        mine = batch[data_rank * per_rank : (data_rank + 1) * per_rank]
        booster.backward(model(input_ids=mine, labels=mine).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    state = cast(GeminiModel, model).ddp.state_dict(only_rank_0=False)
    expected = reference("llama", data)
    assert_matches({n: state[n] for n, _ in expected.named_parameters()}, expected, "hybrid checkpoint in Gemini")
    dist.barrier()


def test_tp2_checkpoint_loads_everywhere(tmp_path: Path) -> None:
    directory = str(tmp_path)
    run_distributed(_save, 2, kind="llama", tp=2, pp=1, optimizer="zero", directory=directory)
    for shard in (True, False):
        _check_plain("llama", directory, shard)
    run_distributed(_resume, 2, kind="llama", tp=1, pp=1, optimizer="zero", directory=directory, shard=True)
    run_distributed(_resume, 2, kind="llama", tp=2, pp=1, optimizer="torch", directory=directory, shard=False)
    run_distributed(_resume_in_gemini, 2, directory=directory)


def test_tp2_pp2_checkpoint_loads_everywhere(tmp_path: Path) -> None:
    directory = str(tmp_path)
    run_distributed(_save, 4, kind="llama", tp=2, pp=2, optimizer="torch", directory=directory)
    for shard in (True, False):
        _check_plain("llama", directory, shard)
    run_distributed(_resume, 2, kind="llama", tp=2, pp=1, optimizer="zero", directory=directory, shard=True)
    run_distributed(_resume, 2, kind="llama", tp=1, pp=2, optimizer="torch", directory=directory, shard=True)


def test_gpt2_tied_tp2_pp2(tmp_path: Path) -> None:
    directory = str(tmp_path)
    run_distributed(_save, 4, kind="gpt2", tp=2, pp=2, optimizer="torch", directory=directory)
    _check_plain("gpt2", directory, True)
    run_distributed(_resume, 2, kind="gpt2", tp=2, pp=1, optimizer="torch", directory=directory, shard=True)


def test_interleaved_pp2_checkpoint(tmp_path: Path) -> None:
    """Two non-adjacent chunks per rank (interleaved schedule, 4 layers over 2 ranks): each rank writes both."""
    directory = str(tmp_path)
    run_distributed(_save, 2, kind="llama4", tp=1, pp=2, optimizer="torch", directory=directory)
    _check_plain("llama4", directory, True)
    run_distributed(_resume, 2, kind="llama4", tp=2, pp=1, optimizer="zero", directory=directory, shard=True)


def test_dp2_tp2_writes_each_tensor_once(tmp_path: Path) -> None:
    """dp replicas stay out of the save: at dp2 x tp2 (ZeRO-2 over dp) the files are the single-process ones."""
    directory = str(tmp_path)
    run_distributed(_save, 4, kind="llama", tp=2, pp=1, optimizer="zero", directory=directory)
    _check_plain("llama", directory, True)


def _bad_inputs(rank: int, world_size: int, directory: str) -> None:
    view, _, io = compose("llama", 2, 1, "torch")
    with pytest.raises(TypeError, match="ParallelModelView"):
        io.save_model(view.module, Path(directory, "m"), shard=True)
    with pytest.raises(ValueError, match="has no LoRA adapters"):
        io.save_lora_as_pretrained(view, Path(directory, "lora"))  # every rank refuses before any collective
    with pytest.raises(ValueError, match="not boosted by this plugin"):
        io.save_optimizer(torch.optim.SGD(view.module.parameters(), lr=0.1), Path(directory, "o"), shard=True)
    Path(directory, "file").write_text("x")
    with pytest.raises(CheckpointError, match=r"is a file|failed on rank"):
        io.save_model(view, Path(directory, "file"), shard=True)  # every rank raises, none waits
    other, _, other_io = compose("gpt2", 2, 1, "torch")
    other_io.save_model(other, Path(directory, "gpt2"), shard=True, use_safetensors=True)
    before = full_params(view)
    with pytest.raises(CheckpointError, match=r"tensor names differ|failed on rank"):
        io.load_model(view, Path(directory, "gpt2"))  # a GPT-2 checkpoint into a Llama: refused everywhere
    for name, value in full_params(view).items():
        assert torch.equal(value, before[name]), f"a refused load changed {name}"
    dist.barrier()


def test_bad_inputs_raise_on_every_rank(tmp_path: Path) -> None:
    run_distributed(_bad_inputs, 2, directory=str(tmp_path))


def _mixed_precision(rank: int, world_size: int, directory: str) -> None:
    """A module cast to bf16 for training (as the hybrid plugin's mixed precision does) saves in the model's fp32
    with `model_dtype` (so fp32 models and the other plugins load it) and loads back into bf16."""
    view, face, _ = compose("llama", 2, 1, "torch")
    train(view, face, batches(1))
    view.module.to(torch.bfloat16)
    io = HybridCheckpointIO(lambda _: None, model_dtype=torch.float32)
    io.save_model(view, Path(directory, "bf16"), shard=True, use_safetensors=True)
    trained = full_params(view)
    with CheckpointReader.open(Path(directory, "bf16"), CheckpointKind.MODEL) as reader:
        for name, value in trained.items():
            stored = reader.read(name)
            assert stored.dtype == torch.float32, name
            torch.testing.assert_close(stored, value.float(), rtol=0, atol=0)
    fresh, _, _ = compose("llama", 2, 1, "torch", seed=1)
    fresh.module.to(torch.bfloat16)
    io.load_model(fresh, Path(directory, "bf16"))
    for name, value in full_params(fresh).items():
        assert value.dtype == torch.bfloat16
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
    dist.barrier()


def test_mixed_precision_saves_the_model_dtype(tmp_path: Path) -> None:
    run_distributed(_mixed_precision, 2, directory=str(tmp_path))
