"""GeminiPlugin with tensor parallelism: ShardFormer over the tp group, Gemini over the zero group, against a
single-process AdamW run with gradient clipping (the global norm spans zero and tp shards, TP replicas counted once);
its checkpoints are the canonical format: a tp2 x zero2 save resumes at tp 1, in LowLevelZero, and back."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import GeneralCheckpointIO
from cx_mesh.testing import TEST_ADAM_EPS, distributed, run_distributed, tiny_model_adam_tolerance
from cx_plugins import Booster, GeminiPlugin, LowLevelZeroPlugin
from cx_plugins._layout import Axis
from cx_plugins.checkpoint_io._tp_shards import TensorParallelShards
from cx_plugins.gemini._plugin import GeminiModel
from cx_shardformer.policies import NoPolicyError
from hybrid_ckpt_helpers import BATCH, LR, RTOL, assert_same_state, batches, build, reference_with_optimizer
from hybrid_ckpt_helpers import assert_matches as assert_same_params

transformers = pytest.importorskip("transformers")

STEPS, SAVED, MAX_NORM = 5, 3, 0.5
ATOL = tiny_model_adam_tolerance(LR, STEPS, tokens=BATCH * 8)  # AdamW at TEST_ADAM_EPS: rounding alone


def _data() -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randint(0, 50, (STEPS, BATCH, 8), generator=generator)


def _reference(steps: int) -> tuple[Any, list[float]]:
    model = build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    norms = []
    for batch in _data()[:steps]:
        model(input_ids=batch, labels=batch).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return model, norms


def _plugin(kind: str, tp: int) -> Any:
    if kind == "gemini":
        return GeminiPlugin(
            precision="fp32",
            tp_size=tp,
            max_norm=MAX_NORM,
            chunk_config_dict={"chunk_size": 1024},
            placement_policy="static",
        )
    return LowLevelZeroPlugin(stage=2, precision="fp32", max_norm=MAX_NORM)


def _boost(kind: str, tp: int, seed: int = 0) -> tuple[Booster, Any, Any, Any]:
    plugin = _plugin(kind, tp)
    booster = Booster(plugin=plugin)
    plain = build("llama", seed)
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    return booster, plugin, model, optimizer


def _train(booster: Booster, plugin: Any, model: Any, optimizer: Any, first: int, last: int) -> list[float]:
    rank, size = plugin.layout.data_rank_and_size()
    per_rank = BATCH // size
    norms = []
    for batch in _data()[first:last]:
        mine = batch[rank * per_rank : (rank + 1) * per_rank]
        booster.backward(model(input_ids=mine, labels=mine).loss, optimizer)
        optimizer.step()
        norms.append(optimizer.get_grad_norm())
        optimizer.zero_grad()
    return norms


def _full_params(plugin: Any, model: Any) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor (collective): Gemini's gathered over zero, then over tp."""
    if isinstance(model, GeminiModel):
        state = model.ddp.state_dict(only_rank_0=False)
        local = {name: tuple(t.shape) for name, t in state.items()}
        shards = TensorParallelShards.of_module(model.unwrap(), plugin.layout.group_or_none(Axis.TP), local)
        return {name: shards.gather(name, tensor) for name, tensor in state.items()}
    return dict(model.unwrap().state_dict())


def _assert_matches(plugin: Any, model: Any, steps: int, what: str) -> None:
    expected = dict(_reference(steps)[0].named_parameters())
    actual = _full_params(plugin, model)
    assert set(expected) <= set(actual), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value.detach(), rtol=RTOL, atol=ATOL, msg=f"{what}: {name}")


def _paths(directory: str) -> tuple[Path, Path]:
    return Path(directory, "model"), Path(directory, "optimizer")


def _run_and_save(rank: int, world_size: int, kind: str, tp: int, directory: str, start: int) -> None:
    """Train from the start (or resume from `directory` after `start` steps), save after SAVED (or STEPS - 1)."""
    booster, plugin, model, optimizer = _boost(kind, tp, seed=0 if start == 0 else 1)
    model_path, optimizer_path = _paths(directory)
    if start:
        booster.load_model(model, model_path)
        booster.load_optimizer(optimizer, optimizer_path)
    stop = SAVED if start == 0 else STEPS - 1
    norms = _train(booster, plugin, model, optimizer, start, stop)
    expected_norms = _reference(stop)[1][start:stop]
    assert norms == pytest.approx(expected_norms, rel=1e-4), f"{kind} tp{tp}: global gradient norms"
    assert max(expected_norms) > MAX_NORM  # clipping really acts
    _assert_matches(plugin, model, stop, f"{kind} tp{tp} after {stop} steps")
    save_to = Path(directory, "next") if start else Path(directory)
    booster.save_model(model, save_to / "model", shard=True, use_safetensors=True, size_per_shard=0.002)
    booster.save_optimizer(optimizer, save_to / "optimizer", shard=True, size_per_shard=0.002)
    dist.barrier()


def _resume_to_end(rank: int, world_size: int, kind: str, tp: int, directory: str, start: int) -> None:
    booster, plugin, model, optimizer = _boost(kind, tp, seed=1)
    model_path, optimizer_path = _paths(directory)
    booster.load_model(model, model_path)
    booster.load_optimizer(optimizer, optimizer_path)
    _assert_matches(plugin, model, start, f"{kind} tp{tp} loaded")
    _train(booster, plugin, model, optimizer, start, STEPS)
    _assert_matches(plugin, model, STEPS, f"{kind} tp{tp} resumed to step {STEPS}")
    dist.barrier()


def test_gemini_tp2_zero2_trains_and_checkpoints_across_plugins(tmp_path: Path) -> None:
    directory = str(tmp_path)
    # tp2 x zero2 from scratch against the single process, saved after SAVED steps
    run_distributed(_run_and_save, 4, kind="gemini", tp=2, directory=directory, start=0)
    # the tp2 checkpoint at tp 1 (Gemini over 2 ranks) and in LowLevelZero, each to the end
    run_distributed(_resume_to_end, 2, kind="gemini", tp=1, directory=directory, start=SAVED)
    # LowLevelZero resumes it, trains one step and saves; Gemini tp2 takes that back to the end
    run_distributed(_run_and_save, 2, kind="zero", tp=1, directory=directory, start=SAVED)
    run_distributed(_resume_to_end, 4, kind="gemini", tp=2, directory=str(Path(directory, "next")), start=STEPS - 1)


@distributed(world_size=2)
def test_gemini_tp_switches(rank: int, world_size: int) -> None:
    """At tp 2 the ShardFormer switches are honoured (no warning); one with nothing to act on fails at boost with
    ShardFormer's clear error."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = GeminiPlugin(precision="fp32", tp_size=2, enable_fused_normalization=True)
    assert not [w for w in caught if "ShardFormer" in str(w.message)]
    model = build("llama")
    boosted, *_ = Booster(plugin=plugin).boost(model)
    assert any(isinstance(m, torch.nn.RMSNorm) for m in cast(GeminiModel, boosted).unwrap().modules())
    overlap = GeminiPlugin(precision="fp32", tp_size=2, enable_sequence_overlap=True)  # no sequence parallelism
    with pytest.raises(ValueError, match="enable_sequence_overlap overlaps split_gather"):
        Booster(plugin=overlap).boost(build("llama"))
    dist.barrier()


@distributed(world_size=2)
def test_gemini_tp_no_policy_says_register_policy(rank: int, world_size: int) -> None:
    """GeminiPlugin has no custom_policy: a model without a policy is told to register one (not to pass ShardFormer's
    policy=, which a plugin user never calls)."""
    booster = Booster(plugin=GeminiPlugin(precision="fp32", tp_size=2))
    with pytest.raises(NoPolicyError, match=r"GeminiPlugin takes no custom_policy: register one with cx_shardformer"):
        booster.boost(torch.nn.Sequential(torch.nn.Linear(4, 4)))


@distributed(world_size=2)
def test_gemini_tp2_with_sequence_parallelism(rank: int, world_size: int) -> None:
    """enable_sequence_parallelism at tp 2 (split_gather): the same norms and parameters as the single process."""
    plugin = GeminiPlugin(
        precision="fp32", tp_size=2, max_norm=MAX_NORM, chunk_config_dict={"chunk_size": 1024},
        enable_sequence_parallelism=True,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    plain = build("llama")
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    norms = _train(booster, plugin, model, optimizer, 0, 2)
    assert norms == pytest.approx(_reference(2)[1], rel=1e-4)
    _assert_matches(plugin, model, 2, "gemini tp2 + sequence parallelism")
    dist.barrier()


def _gpt2_save(rank: int, world_size: int, directory: str) -> None:
    plugin = GeminiPlugin(precision="fp32", tp_size=2, chunk_config_dict={"chunk_size": 1024})
    booster = Booster(plugin=plugin)
    plain = build("gpt2")
    model, optimizer, *_ = booster.boost(plain, torch.optim.AdamW(plain.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    data_rank, data_size = plugin.layout.data_rank_and_size()
    per_rank = BATCH // data_size
    for batch in batches(2):
        mine = batch[data_rank * per_rank : (data_rank + 1) * per_rank]
        booster.backward(model(input_ids=mine, labels=mine).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    booster.save_model(model, Path(directory, "model"), shard=True, use_safetensors=True, size_per_shard=0.002)
    booster.save_optimizer(optimizer, Path(directory, "optimizer"), shard=True, size_per_shard=0.002)
    # single files written in the background: the TP gathers happen before the save returns
    booster.save_model(model, Path(directory, "model.safetensors"), use_safetensors=True, use_async=True)
    booster.save_optimizer(optimizer, Path(directory, "optimizer.safetensors"), use_async=True)
    booster.synchronize()
    dist.barrier()


def test_gemini_tp2_gpt2_tied_checkpoint_is_the_single_process_state(tmp_path: Path) -> None:
    """GPT-2's tied, vocabulary-padded embedding under Gemini tp2 x zero2: the checkpoint holds the single-process
    weights (both tied names, padding stripped) and Adam moments, loadable by transformers and GeneralCheckpointIO."""
    run_distributed(_gpt2_save, 4, directory=str(tmp_path))
    expected, expected_optimizer = reference_with_optimizer("gpt2", batches(2))
    model_class: Any = type(expected)
    loaded = model_class.from_pretrained(Path(tmp_path, "model"))
    assert_same_params(dict(loaded.named_parameters()), expected, "gemini tp2 gpt2 from_pretrained")
    for model_file, optimizer_file in (("model", "optimizer"), ("model.safetensors", "optimizer.safetensors")):
        plain = build("gpt2", seed=1)
        optimizer = torch.optim.AdamW(plain.named_parameters(), lr=LR, eps=TEST_ADAM_EPS)
        io = GeneralCheckpointIO()
        io.load_model(plain, Path(tmp_path, model_file))
        io.load_optimizer(optimizer, Path(tmp_path, optimizer_file))
        assert_same_params(dict(plain.named_parameters()), expected, f"gemini tp2 gpt2 weights ({model_file})")
        assert_same_state(optimizer, expected_optimizer, f"gemini tp2 gpt2 optimizer ({optimizer_file})")
