"""Every plugin switch cx-train has a flag for reaches the plugin it builds (the plugin's own option objects compared,
built in-process from the parsed flags, no training), the switches a plugin has not are refused by name before any
process starts (--fp8-recipe without --fp8 too), --optimizer picks the optimizer (--optimizer-states-dtype its
moments' dtype), and every layout cx-plan prints a command for parses with cx-train's flags back into that layout."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cx_mesh.fp8 import ScalingRecipe
from cx_mesh.testing import run_distributed
from cx_plan import Candidate, Optimizer, train_command
from cx_plugins import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from cx_train.config._arguments import parse_arguments
from cx_train.config._options import parse_options
from cx_train.config._parser import build_parser
from cx_train.models._plugins import make_plugin, plan_candidate, plugin_extras
from cx_train.models._spec import build_model, describe_model
from cx_train.step._optimization import make_optimizer
from cx_zero import CPUAdam, FusedAdam, HybridAdam, MuonWithAdamW

LLAMA = ["--model", "llama", "--seq-len", "16", "--batch-size", "2"]
_MOE_MUON = ["--model", "mixtral", "--plugin", "moe_hybrid", "--optimizer", "muon"]


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_options(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def _hybrid_switches(rank: int, world_size: int) -> None:
    flags = [*LLAMA, "--plugin", "hybrid", "--nproc", "2", "--tp", "2", "--sp-mode", "split_gather"]
    flags += ["--sequence-overlap", "--jit-fused", "--fused-normalization", "--activation-checkpointing-ratio", "0.5"]
    plugin, _ = make_plugin(parse_options(flags))
    assert isinstance(plugin, HybridParallelPlugin)
    o = plugin.options
    assert (o.tp_size, o.sp_mode.value) == (2, "split_gather")
    assert o.shardformer.enable_sequence_overlap
    assert o.shardformer.enable_jit_fused
    assert o.shardformer.enable_fused_normalization
    assert o.shardformer.gradient_checkpoint_config is not None
    assert o.shardformer.gradient_checkpoint_config.gradient_checkpointing_ratio == 0.5
    assert o.shardformer.fp8_recipe is ScalingRecipe.TENSORWISE  # the default
    flags = [*LLAMA, "--plugin", "hybrid", "--nproc", "2", "--sp", "2", "--sp-mode", "ring_attn", "--zero", "1"]
    fp8 = ["--fp8", "--fp8-recipe", "blockwise", "--fp8-communication"]
    plugin, _ = make_plugin(parse_options([*flags, "--cpu-offload", *fp8]))
    assert isinstance(plugin, HybridParallelPlugin)
    o = plugin.options
    assert (o.sp_size, o.sp_mode.value, o.zero.stage, o.zero.cpu_offload) == (2, "ring_attn", 1, True)
    assert o.shardformer.use_fp8
    assert o.shardformer.fp8_recipe is ScalingRecipe.BLOCKWISE
    assert o.zero.fp8_communication
    assert o.pipeline.fp8_communication
    plugin, _ = make_plugin(parse_options([*flags, "--optimizer-states-dtype", "bf16"]))
    assert isinstance(plugin, HybridParallelPlugin)
    assert plugin.options.zero.optimizer_states_dtype == torch.bfloat16
    moe = ["--model", "mixtral", "--seq-len", "16", "--batch-size", "2", "--plugin", "moe_hybrid", "--nproc", "2"]
    plugin, _ = make_plugin(parse_options([*moe, "--ep", "2", "--fp8", "--fp8-recipe", "rowwise"]))
    assert isinstance(plugin, MoeHybridParallelPlugin)
    assert plugin.options.shardformer.fp8_recipe is ScalingRecipe.ROWWISE  # the dense layers
    assert plugin._moe_fp8.matmul.recipe is ScalingRecipe.ROWWISE  # the experts


def _data_parallel_switches(rank: int, world_size: int) -> None:
    flags = ["--plugin", "low_level_zero", "--nproc", "1", "--cpu-offload", "--fp8", "--fp8-communication"]
    plugin, _ = make_plugin(parse_options(flags))
    assert isinstance(plugin, LowLevelZeroPlugin)
    assert plugin.options.zero.cpu_offload
    assert plugin.options.use_fp8
    assert plugin.options.fp8_recipe is ScalingRecipe.TENSORWISE  # the default
    assert plugin.options.zero.fp8_communication
    flags = ["--plugin", "low_level_zero", "--nproc", "1", "--fp8", "--fp8-recipe", "rowwise"]
    plugin, _ = make_plugin(parse_options(flags))
    assert isinstance(plugin, LowLevelZeroPlugin)
    assert plugin.options.fp8_recipe is ScalingRecipe.ROWWISE
    flags = ["--plugin", "gemini", "--nproc", "1", "--shard-fraction", "0.5", "--offload-optim-fraction", "0.25"]
    plugin, _ = make_plugin(parse_options([*flags, "--fp8", "--fp8-recipe", "blockwise"]))
    assert isinstance(plugin, GeminiPlugin)
    ddp = plugin.options.ddp
    assert (ddp.placement.value, ddp.shard_param_frac, ddp.offload_optim_frac) == ("static", 0.5, 0.25)
    assert plugin.options.use_fp8
    assert plugin.options.fp8_recipe is ScalingRecipe.BLOCKWISE
    flags = ["--plugin", "gemini", "--nproc", "1", "--offload-optim-fraction", "1", "--offload-param-fraction", "0.75"]
    plugin, _ = make_plugin(parse_options(flags))
    assert isinstance(plugin, GeminiPlugin)
    assert (plugin.options.ddp.offload_optim_frac, plugin.options.ddp.offload_param_frac) == (1.0, 0.75)
    plugin, _ = make_plugin(parse_options(["--plugin", "gemini", "--nproc", "1", "--placement", "auto"]))
    assert isinstance(plugin, GeminiPlugin)
    assert plugin.options.ddp.placement.value == "auto"
    assert plugin.options.optimizer.optimizer_states_dtype == torch.float32  # the default
    for name in ("low_level_zero", "gemini"):
        plugin, _ = make_plugin(parse_options(["--plugin", name, "--nproc", "1", "--optimizer-states-dtype", "bf16"]))
        assert isinstance(plugin, LowLevelZeroPlugin | GeminiPlugin)
        zero = plugin.options.zero if isinstance(plugin, LowLevelZeroPlugin) else plugin.options.optimizer
        assert zero.optimizer_states_dtype == torch.bfloat16, name
    plugin, _ = make_plugin(parse_options(["--plugin", "torch_ddp", "--nproc", "1", "--fp8-communication"]))
    assert isinstance(plugin, TorchDDPPlugin)
    assert plugin.fp8_communication
    options = parse_options([*LLAMA, "--plugin", "torch_fsdp", "--nproc", "1", "--fsdp-wrap", "model"])
    plugin, _ = make_plugin(options, build_model(describe_model(options.model_spec), seed=0))
    assert isinstance(plugin, TorchFSDPPlugin)
    assert plugin.options.wrap_policy is None


@pytest.mark.filterwarnings("ignore::UserWarning")  # fp8 communication on one rank: nothing to compress
def test_train_switches_reach_the_hybrid_plugin() -> None:
    pytest.importorskip("transformers")
    outcomes = run_distributed(_hybrid_switches, 2)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_train_switches_reach_the_data_parallel_plugins() -> None:
    pytest.importorskip("transformers")
    outcomes = run_distributed(_data_parallel_switches, 1)
    assert all(o.ok for o in outcomes.values()), [o.error for o in outcomes.values()]


def test_train_fp8_recipe_parsed_once_into_the_options() -> None:
    """--fp8-recipe is a ScalingRecipe in the options (tensorwise by default) and reaches the plugin's constructor
    only with --fp8, beside the planner's Candidate (which judges no fp8)."""
    options = parse_options(["--plugin", "low_level_zero", "--nproc", "1", "--fp8", "--fp8-recipe", "blockwise"])
    assert options.switches.fp8_recipe is ScalingRecipe.BLOCKWISE
    assert plugin_extras(options) == {"use_fp8": True, "fp8_recipe": ScalingRecipe.BLOCKWISE}
    options = parse_options(["--plugin", "low_level_zero", "--nproc", "1"])
    assert options.switches.fp8_recipe is ScalingRecipe.TENSORWISE
    assert plugin_extras(options) == {}
    text = " ".join(build_parser().format_help().split())
    assert "--fp8-recipe {tensorwise,rowwise,blockwise}" in text
    assert "needs --fp8 unless tensorwise (default: tensorwise)" in text


def test_train_sequence_overlap_goes_with_fp8() -> None:
    """The overlap ring computes and sends in fp8 (cx-shardformer's _overlap), so --sequence-overlap takes both fp8
    switches."""
    flags = ["--plugin", "hybrid", "--nproc", "2", "--tp", "2", "--sp-mode", "split_gather", "--sequence-overlap"]
    options = parse_options([*flags, "--fp8", "--fp8-communication"])
    extras = plugin_extras(options)
    assert (extras["use_fp8"], extras["fp8_communication"], extras["enable_sequence_overlap"]) == (True, True, True)


def test_train_tp_help_names_gemini() -> None:
    """--tp is GeminiPlugin's tp_size too, so its heading says so beside hybrid's."""
    text = " ".join(build_parser().format_help().split())
    assert "hybrid parallelism (--plugin hybrid / moe_hybrid; --tp also gemini):" in text
    assert "also --plugin gemini's tp_size" in text


@pytest.mark.parametrize(
    ("name", "kind"),
    [("adamw", "AdamW"), ("hybrid_adam", HybridAdam), ("fused_adam", FusedAdam), ("cpu_adam", CPUAdam)],
)
def test_train_optimizer_flag_picks_the_optimizer(name: str, kind: object) -> None:
    options = parse_options(["--nproc", "1", "--optimizer", name, "--weight-decay", "0.1", "--lr", "2e-3"])
    model = build_model(describe_model(options.model_spec), seed=0)
    optimizer = make_optimizer(model, options)
    assert type(optimizer).__name__ == kind if isinstance(kind, str) else type(optimizer) is kind
    assert optimizer.param_groups[0]["lr"] == 2e-3
    assert optimizer.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--plugin", "torch_fsdp", "--fp8"], "--fp8 is not supported by --plugin torch_fsdp; use --plugin"),
        (["--plugin", "torch_fsdp", "--fp8-communication"], "--fp8-communication is not supported by --plugin"),
        (
            ["--plugin", "gemini", "--fp8-recipe", "rowwise"],
            "--fp8-recipe rowwise sets how --fp8 scales its matmuls: it needs --fp8",
        ),
        (["--plugin", "torch_ddp", "--fp8-recipe", "blockwise"], "--fp8-recipe blockwise sets how --fp8 scales"),
        (["--plugin", "torch_fsdp", "--fp8", "--fp8-recipe", "blockwise"], "--fp8 is not supported by --plugin"),
        (["--plugin", "gemini", "--sp-mode", "ring"], "--sp-mode ring: cx-train has no flag for GeminiPlugin's"),
        (["--plugin", "hybrid", "--sp-mode", "split_gather"], "--sp-mode split_gather splits the sequence over"),
        (["--plugin", "hybrid", "--sp-mode", "all_to_all"], "--sp-mode all_to_all splits the sequence over its own"),
        (["--plugin", "hybrid", "--tp", "2", "--sequence-overlap"], "--sequence-overlap overlaps split_gather's"),
        (["--plugin", "gemini", "--jit-fused"], "--jit-fused is not supported by --plugin gemini"),
        (["--plugin", "low_level_zero", "--placement", "auto"], "--placement is not supported by --plugin"),
        (
            ["--plugin", "gemini", "--placement", "auto", "--shard-fraction", "0.5"],
            "--shard-fraction sets a static placement's fractions",
        ),
        (["--plugin", "gemini", "--offload-param-fraction", "0.5"], "--offload-param-fraction offloads master"),
        (["--plugin", "torch_ddp", "--cpu-offload"], "--cpu-offload is not supported by --plugin torch_ddp"),
        (["--plugin", "hybrid", "--cpu-offload"], "--cpu-offload offloads ZeRO 1/2 optimizer states"),
        (["--plugin", "gemini", "--fsdp-wrap", "model"], "--fsdp-wrap model is not supported by --plugin gemini"),
        (["--plugin", "moe_hybrid", "--lora-rank", "4"], "--lora-rank is not supported by --plugin moe_hybrid"),
        (
            ["--model", "llama", "--plugin", "gemini", "--lora-rank", "4", "--merge-lora"],
            "--merge-lora is not supported by --plugin gemini",
        ),
        (["--plugin", "torch_ddp", "--lora-rank", "4"], "--lora-rank: LoRA goes through peft"),
        (["--merge-lora"], "--merge-lora needs --lora-rank N"),
        (
            ["--plugin", "torch_ddp", "--optimizer-states-dtype", "bf16"],
            "--optimizer-states-dtype bf16 is not supported by --plugin torch_ddp; use --plugin low_level_zero or "
            "gemini or hybrid or moe_hybrid (its optimizer keeps fp32 moments)",
        ),
        (["--plugin", "torch_fsdp", "--optimizer-states-dtype", "bf16"], "is not supported by --plugin torch_fsdp"),
        (
            ["--plugin", "hybrid", "--tp", "2", "--optimizer-states-dtype", "bf16"],
            "--optimizer-states-dtype bf16 is ZeRO's optimizer option: --plugin hybrid needs --zero 1 or 2",
        ),
        (["--plugin", "hybrid", "--tp", "2", "--sp-mode", "ring", "--seq-len", "15"], "--seq-len 15 must be a"),
        (
            ["--plugin", "low_level_zero", "--optimizer", "muon", "--optimizer-states-dtype", "bf16"],
            "--optimizer muon keeps fp32 states",
        ),
        # GeminiPlugin's sequence parallelism has no cx-train flag: --sp-mode / --sp stay hybrid's
        (
            ["--plugin", "gemini", "--tp", "2", "--sp-mode", "split_gather"],
            "--sp-mode split_gather: cx-train has no flag for GeminiPlugin's sequence parallelism (--plugin gemini "
            "takes --tp alone); use --plugin hybrid or moe_hybrid",
        ),
        (["--plugin", "gemini", "--tp", "2", "--sp", "2"], "--sp: cx-train has no flag for GeminiPlugin's sequence"),
        (["--plugin", "gemini", "--tp", "2", "--pp", "2"], "(not gemini; gemini takes --tp alone)"),
    ],
)
def test_train_switches_refused_by_name(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in _refused([*flags, "--nproc", "2"], capsys)


@pytest.mark.parametrize(
    "flags",
    [
        ["--plugin", "torch_ddp"],
        ["--plugin", "torch_fsdp"],  # Newton-Schulz on each matrix gathered to an owner rank
        ["--plugin", "low_level_zero", "--zero", "1"],
        ["--plugin", "gemini"],
        ["--plugin", "gemini", "--tp", "2"],  # a dp owner's tp slices, then a tp owner (on-device masters)
        ["--plugin", "gemini", "--tp", "2", "--placement", "auto"],  # CPU masters, tp collectives on the device
        ["--plugin", "gemini", "--tp", "2", "--offload-optim-fraction", "0.5"],
        ["--plugin", "hybrid", "--tp", "2"],
        ["--plugin", "hybrid", "--zero", "1"],
        ["--plugin", "hybrid", "--tp", "2", "--zero", "1"],  # a dp owner of each slice, then a tp owner
        ["--plugin", "hybrid", "--tp", "2", "--zero", "2"],
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "2"],
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "2", "--zero", "1"],
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--tp", "2"],
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--tp", "2", "--zero", "1"],  # dp owners, then tp owners
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--tp", "2", "--zero", "2"],
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--tp", "2", "--pp", "2", "--zero", "1", "--nproc", "4"],
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--tp", "2", "--zero", "2", "--sp-mode", "split_gather"],
        ["--plugin", "hybrid", "--tp", "2", "--zero", "1", "--cpu-offload"],  # CPU masters, tp collectives on device
        ["--model", "mixtral", "--plugin", "moe_hybrid", "--tp", "2", "--zero", "2", "--cpu-offload"],
    ],
)
def test_train_muon_accepted_where_the_plugin_steps_whole_matrices(flags: list[str]) -> None:
    assert parse_options(["--nproc", "2", *flags, "--optimizer", "muon"]).optimizer == "muon"


def test_train_muon_groups_follow_the_recipe() -> None:
    """--optimizer muon: the hidden matrices by Muon, the embeddings, output head and 1-D parameters by AdamW, one
    --lr and --weight-decay for both (Muon's match_rms_adamw scaling)."""
    pytest.importorskip("transformers")
    flags = ["--plugin", "low_level_zero", "--nproc", "1", "--optimizer", "muon", "--lr", "2e-3"]
    options = parse_options([*LLAMA, *flags, "--weight-decay", "0.1"])
    model = build_model(describe_model(options.model_spec), seed=0)
    optimizer = make_optimizer(model, options)
    assert isinstance(optimizer, MuonWithAdamW)
    kinds = {id(p): g["use_muon"] for g in optimizer.param_groups for p in g["params"]}
    names = {name: kinds[id(p)] for name, p in model.named_parameters()}
    assert not any(use for name, use in names.items() if "embed" in name or "lm_head" in name or "norm" in name)
    assert all(use for name, use in names.items() if name.endswith("proj.weight"))
    assert {g["lr"] for g in optimizer.param_groups} == {2e-3}
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.1}
    assert optimizer.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"


def test_train_switch_refused_before_any_rank_starts(tmp_path: Path) -> None:
    """The refusal comes from the launcher: no rank starts, and nothing is written."""
    command = [sys.executable, "-m", "cx_train", "--plugin", "torch_fsdp", "--fp8", "--save", str(tmp_path / "c")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "cx-train: error: --fp8 is not supported by --plugin torch_fsdp" in result.stderr
    assert "rank" not in result.stdout
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "candidate",
    [
        Candidate("hybrid", tp=2, pp=2, zero_stage=0, num_microbatches=2, pp_style="zbv", sp_mode="split_gather"),
        Candidate("hybrid", dp=2, tp=2, sp_mode="ring", zero_stage=1, cpu_offload=True, precision="fp32"),
        Candidate("hybrid", dp=2, sp=2, sp_mode="ring_attn", zero_stage=0, checkpoint_ratio=0.5, micro_batch_size=2),
        Candidate("hybrid", sp=4, sp_mode="ring_attn", zero_stage=0),  # more sp ranks than llama's 2 kv heads
        Candidate("moe_hybrid", dp=2, ep=2, sp=2, sp_mode="all_to_all", zero_stage=2, num_microbatches=2),
        Candidate("gemini", dp=2, offload_optim_frac=1.0, offload_param_frac=0.5),
        Candidate("gemini", dp=4, placement_policy="auto", precision="fp16"),
        Candidate("torch_fsdp", dp=2),
        Candidate("torch_fsdp", dp=2, fsdp_wrap="block", checkpoint_ratio=1.0, checkpoint_mode="selective-op"),
        Candidate("low_level_zero", dp=2, zero_stage=1, cpu_offload=True),
        Candidate("low_level_zero", dp=2, zero_stage=2, optimizer_states_dtype="bf16"),
        Candidate("gemini", dp=2, precision="bf16", optimizer_states_dtype="bf16"),
        Candidate("hybrid", dp=2, tp=2, zero_stage=1, optimizer_states_dtype="bf16"),
        # --optimizer muon on each layout cx-plan offers it on
        Candidate("torch_ddp", dp=2, optimizer=Optimizer.MUON),
        Candidate("low_level_zero", dp=2, zero_stage=2, optimizer=Optimizer.MUON),
        Candidate("gemini", dp=2, precision="bf16", optimizer=Optimizer.MUON),
        # GeminiPlugin(tp_size=2): each layout cx-plan enumerates at tp > 1
        Candidate("gemini", tp=2, precision="bf16"),
        Candidate("gemini", dp=2, tp=2, offload_optim_frac=1.0, checkpoint_ratio=1.0),
        Candidate("gemini", dp=2, tp=2, placement_policy="auto"),
        Candidate("hybrid", dp=2, tp=2, zero_stage=0, optimizer=Optimizer.MUON),
        Candidate("moe_hybrid", dp=2, ep=2, zero_stage=1, optimizer=Optimizer.MUON),
    ],
    ids=lambda c: c.label(),
)
def test_train_every_printed_plan_command_parses_into_its_layout(candidate: Candidate) -> None:
    """cx-plan's printed command has no "cx-train has no flag" note left: cx-train's parser reads it back into the
    very candidate (validated with the model, as the launcher does)."""
    pytest.importorskip("transformers")
    model = "mixtral" if candidate.plugin == "moe_hybrid" else "llama"
    command = train_command(candidate, model, 32, ("--num-layers", "4"))
    assert "#" not in command
    options = parse_options(shlex.split(command)[1:])
    assert plan_candidate(options, candidate.world_size) == candidate


def test_train_switches_are_config_file_keys(tmp_path: Path) -> None:
    """Every switch has its --config key (the flag's name with - or _), read before the command line."""
    config = tmp_path / "run.toml"
    config.write_text(
        'plugin = "hybrid"\ntp = 2\nsp-mode = "split_gather"\nsequence_overlap = true\njit-fused = true\n'
        'optimizer = "fused_adam"\nactivation_checkpointing_ratio = 0.5\noptimizer-states-dtype = "bf16"\n'
        'fp8 = true\nfp8-recipe = "blockwise"\n'
    )
    arguments = parse_arguments(["--config", str(config), "--optimizer", "cpu_adam"])
    assert (arguments.sp_mode, arguments.sequence_overlap, arguments.jit_fused) == ("split_gather", True, True)
    assert (arguments.optimizer, arguments.activation_checkpointing_ratio) == ("cpu_adam", 0.5)  # the command line wins
    assert arguments.optimizer_states_dtype == "bf16"
    assert (arguments.fp8, arguments.fp8_recipe) == (True, "blockwise")
    config.write_text('plugin = "low_level_zero"\nlora-rank = 4\nlora_targets = "q_proj,v_proj"\nmerge-lora = true\n')
    arguments = parse_arguments(["--config", str(config)])
    assert (arguments.lora_rank, arguments.lora_targets, arguments.merge_lora) == (4, "q_proj,v_proj", True)


def test_train_muon_steps_expert_stacks_by_muon() -> None:
    """--optimizer muon on an MoE model: the fused expert stacks ((experts, out, in)) by Muon, each expert's matrix
    on its own (cx_zero.muon_param_groups), the routers and attention matrices too."""
    pytest.importorskip("transformers")
    flags = ["--model", "mixtral", "--seq-len", "16", "--batch-size", "2", "--plugin", "moe_hybrid", "--ep", "2"]
    options = parse_options([*flags, "--nproc", "2", "--optimizer", "muon"])
    model = build_model(describe_model(options.model_spec), seed=0)
    optimizer = make_optimizer(model, options)
    assert isinstance(optimizer, MuonWithAdamW)
    kinds = {id(p): g["use_muon"] for g in optimizer.param_groups for p in g["params"]}
    stacks = {name: kinds[id(p)] for name, p in model.named_parameters() if p.ndim == 3}
    assert stacks
    assert all(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in stacks)
    assert all(stacks.values())
