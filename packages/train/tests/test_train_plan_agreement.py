"""cx-train and cx-plan agree: the planner counts the model cx-train builds, the plugin cx-train makes is the
candidate's (per-block FSDP included), the commands cx-plan prints parse with cx-train's parser into that candidate,
and the built-in models' vocabulary the planner assumes is cx-train's character encoding."""

from __future__ import annotations

import shlex

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from cx_mesh.testing import run_distributed
from cx_plan import TEXT_VOCAB_SIZE, Candidate, Optimizer, load_model_shape, train_command
from cx_plan import build_parser as plan_parser
from cx_plugins import GeminiPlugin, LowLevelZeroPlugin, ModelWrapper, TorchDDPPlugin
from cx_train import CharTokenizer
from cx_train.config._options import parse_options
from cx_train.config._parser import DEFAULT_HIDDEN, DEFAULT_LAYERS, build_parser
from cx_train.models._plugins import make_plugin, plan_candidate
from cx_train.models._spec import ModelSpec, build_model, describe_model


@pytest.mark.parametrize("name", ["gpt", "llama", "mixtral", "deepseek_v3"])
def test_train_plan_counts_match_the_model_cx_train_builds(name: str) -> None:
    if name != "gpt":
        pytest.importorskip("transformers")
    shape = load_model_shape(name, hidden_size=32, num_layers=2, seq_len=16)
    model = build_model(describe_model(ModelSpec(name, 32, 2, 16)), seed=0)
    counts = shape.parameters
    assert shape.vocab_size == TEXT_VOCAB_SIZE
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.total == counts.outer + sum(counts.dense_per_layer) + counts.experts
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n)
    assert counts.experts == experts
    if shape.is_moe:
        assert counts.per_expert * shape.num_experts == max(counts.experts_per_layer)
    assert counts.tied == (name == "gpt")


def test_train_plan_defaults_are_cx_train_defaults() -> None:
    """A plan without flags is of the run cx-train makes without them (cx-plan planned bf16 while cx-train trained
    fp32)."""
    planned, trained = plan_parser().parse_args(["--model", "gpt", "--world", "2"]), build_parser().parse_args([])
    assert planned.precision == trained.precision == "fp32"
    assert planned.optimizer_states_dtype == trained.optimizer_states_dtype == "fp32"
    assert planned.optimizer == trained.optimizer == "adamw"
    assert (planned.hidden_size, planned.num_layers) == (DEFAULT_HIDDEN, DEFAULT_LAYERS)


def test_train_plan_text_vocabulary_is_the_character_encoding() -> None:
    assert CharTokenizer().vocab_size == TEXT_VOCAB_SIZE


def test_train_plan_printed_commands_parse_into_the_candidate() -> None:
    hybrid = Candidate(
        "hybrid", dp=2, tp=2, pp=2, micro_batch_size=2, num_microbatches=4, zero_stage=1, checkpoint_ratio=1.0
    )
    moe = Candidate("moe_hybrid", dp=4, ep=2, sp=2, sp_mode="all_to_all", micro_batch_size=1, num_microbatches=2)
    ddp = Candidate("torch_ddp", dp=4, micro_batch_size=2, num_microbatches=3, precision="fp32")
    muon = Candidate("low_level_zero", dp=2, zero_stage=1, optimizer=Optimizer.MUON)  # cx-train's MuonWithAdamW
    tp_muon = Candidate("hybrid", dp=1, tp=2, zero_stage=0, optimizer=Optimizer.MUON)  # whole matrices at ZeRO 0
    fsdp_muon = Candidate("torch_fsdp", dp=2, optimizer=Optimizer.MUON)  # row shards, Newton-Schulz at owners
    zero_tp_muon = Candidate("hybrid", dp=2, tp=2, zero_stage=1, optimizer=Optimizer.MUON)  # dp, then tp owners
    moe_zero_tp_muon = Candidate("moe_hybrid", dp=2, tp=2, ep=2, zero_stage=2, optimizer=Optimizer.MUON)
    parser = build_parser()
    for candidate, expected in (
        (hybrid, {"plugin": "hybrid", "nproc": 8, "tp": 2, "pp": 2, "zero": 1, "batch_size": 8, "microbatches": 4}),
        (moe, {"plugin": "moe_hybrid", "nproc": 8, "ep": 2, "sp": 2, "batch_size": 1, "grad_accum": 2}),
        (ddp, {"plugin": "torch_ddp", "nproc": 4, "batch_size": 2, "grad_accum": 3, "precision": "fp32"}),
        (Candidate("low_level_zero", dp=2, zero_stage=1), {"plugin": "low_level_zero", "zero": 1}),
        (muon, {"plugin": "low_level_zero", "zero": 1, "optimizer": "muon"}),
        (tp_muon, {"plugin": "hybrid", "tp": 2, "zero": 0, "optimizer": "muon"}),
        (fsdp_muon, {"plugin": "torch_fsdp", "nproc": 2, "optimizer": "muon"}),
        (zero_tp_muon, {"plugin": "hybrid", "tp": 2, "zero": 1, "optimizer": "muon"}),
        (moe_zero_tp_muon, {"plugin": "moe_hybrid", "nproc": 4, "tp": 2, "ep": 2, "zero": 2, "optimizer": "muon"}),
    ):
        command = train_command(candidate, "mixtral", 64, ("--hidden-size", "96", "--num-layers", "3"))
        assert "#" not in command
        arguments = parser.parse_args(shlex.split(command)[1:])
        for name, value in expected.items():
            assert getattr(arguments, name) == value, (name, command)
        assert (arguments.seq_len, arguments.hidden_size, arguments.num_layers) == (64, 96, 3)
    assert parser.parse_args(shlex.split(train_command(hybrid, "gpt", 32))[1:]).activation_checkpointing
    for candidate in (ddp, Candidate("low_level_zero", dp=2, zero_stage=1), muon, tp_muon, fsdp_muon, zero_tp_muon):
        options = parse_options(shlex.split(train_command(candidate, "gpt", 64))[1:])
        assert plan_candidate(options, candidate.world_size) == candidate
    options = parse_options(shlex.split(train_command(moe_zero_tp_muon, "mixtral", 64))[1:])  # cx-train takes it
    assert plan_candidate(options, moe_zero_tp_muon.world_size) == moe_zero_tp_muon


def _cx_train_plugins(rank: int, world_size: int) -> None:
    """The plugin cx-train makes from the flags is the candidate's: per-block FSDP wraps each decoder layer, the
    LowLevelZero stage follows --zero, Gemini and DDP are the plain plugins."""
    options = parse_options(["--model", "llama", "--plugin", "torch_fsdp", "--nproc", "1"], world_size=world_size)
    model = build_model(describe_model(options.model_spec), seed=0)
    plugin, _ = make_plugin(options, model)
    boosted, *_ = plugin.configure(model, torch.optim.AdamW(model.parameters()))
    assert isinstance(boosted, ModelWrapper)
    layers = [m for m in boosted.unwrap().modules() if type(m).__name__.startswith("FSDPLlamaDecoderLayer")]
    assert len(layers) == options.num_layers > 1
    assert all(isinstance(layer, FSDPModule) for layer in layers)
    zero1, _ = make_plugin(parse_options(["--plugin", "low_level_zero", "--zero", "1", "--nproc", "1"]))
    assert isinstance(zero1, LowLevelZeroPlugin)
    assert zero1.options.stage == 1
    assert isinstance(make_plugin(parse_options(["--plugin", "gemini", "--nproc", "1"]))[0], GeminiPlugin)
    ddp, mixed = make_plugin(parse_options(["--plugin", "torch_ddp", "--precision", "bf16", "--nproc", "1"]))
    assert isinstance(ddp, TorchDDPPlugin)
    assert mixed == "bf16"


def test_train_plan_make_plugin_is_the_candidates() -> None:
    pytest.importorskip("transformers")
    outcomes = run_distributed(_cx_train_plugins, 1)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]
