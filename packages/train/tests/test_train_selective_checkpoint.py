"""Selective op activation checkpointing (torchtitan's "op" policy) as a cx option: the policy's decisions, gradients
equal to those without checkpointing, cx-plan's trace between no and full checkpointing, the prediction against a
measured run, and cx-train's `--activation-checkpointing-mode`.

Gradients: checkpointing changes which tensors are kept, not what is computed. The recomputed ops run the same CPU
kernels on the same inputs as the first forward (no dropout in these models), and the saved outputs are the first
forward's own tensors, so every gradient is bit-identical to the run without checkpointing (`torch.equal`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from cx_plan import (
    Candidate,
    Device,
    ModelShape,
    SearchSpace,
    Verdict,
    enumerate_candidates,
    load_model_shape,
    main,
    measure_candidate,
    predict_memory,
    trace_stage,
    train_command,
)
from cx_plugins import SelectiveOpPolicy, enable_activation_checkpointing
from cx_train.config._options import parse_options
from cx_train.models._spec import ModelSpec, build_model, describe_model

HIDDEN, LAYERS, SEQ = 64, 2, 32
_TOLERANCE = 0.10  # the bar for predicted against measured peaks
_MM, _SDPA = torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def test_policy_saves_every_other_matmul_and_attention() -> None:
    policy = SelectiveOpPolicy()
    forward, recompute = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert [policy(forward, _MM) for _ in range(3)] == [save, again, save]
    assert policy(recompute, _MM) == save  # the recompute counts on its own, so it decides as the forward did
    assert policy(forward, _SDPA) == save
    assert policy(forward, torch.ops.aten.add.Tensor) == again
    with pytest.raises(ValueError, match="activation checkpointing mode 'op'"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2), "op")


def _gradients(mode: str | None) -> dict[str, torch.Tensor]:
    described = describe_model(ModelSpec("llama", HIDDEN, LAYERS, SEQ))
    model = build_model(described, seed=0)
    if mode is not None:
        enable_activation_checkpointing(model, mode)
    ids = (torch.arange(2 * SEQ) * 7).reshape(2, SEQ) % described.tokenizer.vocab_size
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def test_selective_op_gradients_equal_those_without_checkpointing() -> None:
    plain, selective = _gradients(None), _gradients("selective-op")
    assert plain.keys() == selective.keys()
    assert all(torch.equal(plain[name], selective[name]) for name in plain)


def _candidate(ratio: float, mode: str = "full") -> Candidate:
    return Candidate("torch_ddp", micro_batch_size=2, precision="fp32", checkpoint_ratio=ratio, checkpoint_mode=mode)


def test_trace_under_selective_op_lies_between_none_and_full_and_matches_a_run() -> None:
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    none, full = trace_stage(shape, _candidate(0.0), SEQ), trace_stage(shape, _candidate(1.0), SEQ)
    selective = trace_stage(shape, _candidate(1.0, "selective-op"), SEQ)
    assert full.saved_bytes < selective.saved_bytes < none.saved_bytes
    assert full.activation_bytes < selective.activation_bytes < none.activation_bytes
    predicted = predict_memory(shape, _candidate(1.0, "selective-op"), SEQ).peak
    measured = measure_candidate(_candidate(1.0, "selective-op"), "llama", hidden=HIDDEN, layers=LAYERS, seq_len=SEQ,
                                 steps=1)  # fmt: skip
    assert not measured.error, measured.error
    assert abs(predicted - measured.peak) <= _TOLERANCE * measured.peak, (predicted, measured.peak)


def test_candidate_and_cx_train_flag() -> None:
    selective = _candidate(1.0, "selective-op")
    assert "ckpt-op" in selective.label()
    assert "--activation-checkpointing-mode selective-op" in train_command(selective, "llama", SEQ)
    with pytest.raises(ValueError, match="ShardFormer's policies, a ratio of whole layers only"):
        Candidate("hybrid", checkpoint_ratio=1.0, checkpoint_mode="selective-op")
    with pytest.raises(ValueError, match=r"checkpoint_ratio 1, not 0\)"):
        Candidate("torch_ddp", checkpoint_mode="selective-op")
    flags: list[Any] = ["--model", "llama", "--plugin", "torch_fsdp", "--activation-checkpointing-mode", "selective-op"]
    options = parse_options(flags, world_size=2)
    assert (options.activation_checkpointing, options.checkpoint_mode) == (True, "selective-op")
    assert parse_options(flags[:4], world_size=2).checkpoint_mode == "full"


def test_cx_plan_tries_selective_op_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    llama = ["--model", "llama", "--hidden-size", "32", "--num-layers", "2", "--seq-len", "32", "--world", "2"]
    flags = [*llama, "--device", "cpu", "--plugins", "torch_fsdp", "--checkpointing", "0,op", "--all", "--json"]
    assert main(flags, memory_factory=_states_only) == 0
    rows = [row["candidate"] for row in json.loads(capsys.readouterr().out)["rows"]]
    assert {(row["checkpoint_ratio"], row["checkpoint_mode"]) for row in rows} == {(0.0, "full"), (1.0, "selective-op")}
    shape = load_model_shape("llama", hidden_size=32, num_layers=2, seq_len=32)
    modes = ("selective-op",)
    space = SearchSpace(plugins=("hybrid", "low_level_zero"), checkpoint_ratios=(0.0,), checkpoint_modes=modes)
    offered = enumerate_candidates(shape, 2, 32, space)
    assert {c.plugin for c in offered if c.checkpoint_mode == "selective-op"} == {"low_level_zero"}  # not ShardFormer's


def _states_only(shape: ModelShape, seq_len: int, device: Device) -> Callable[[Candidate], Verdict]:
    """Every candidate fits (this test is about which candidates are offered, not their memory)."""
    return lambda candidate: Verdict(True, 1, device.memory_bytes, "", None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("plugin", "message"),
    [
        ("hybrid", "checkpoints whole layers through ShardFormer's policies"),
        ("gemini", "--plugin gemini --tp 2: torchtitan's op policy is untested around ShardFormer's"),
    ],
)
def test_cx_train_refuses_selective_op_around_shardformer_tp(
    plugin: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--model", "llama", "--plugin", plugin, "--tp", "2", "--activation-checkpointing-mode", "selective-op"]
    with pytest.raises(SystemExit):
        parse_options(flags, world_size=2)
    assert message in capsys.readouterr().err
    gemini_tp1 = ["--model", "llama", "--plugin", "gemini", "--activation-checkpointing-mode", "selective-op"]
    assert parse_options(gemini_tp1, world_size=2).checkpoint_mode == "selective-op"  # no ShardFormer at tp 1
