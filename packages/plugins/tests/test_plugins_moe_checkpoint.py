"""MoeHybridParallelPlugin checkpoints: expert slices gathered over ep (and tp) into transformers 5's fused names and
full shapes, optimizer state by name, loads that reshard.

Each test trains tiny HF Mixtral / Qwen3-MoE / DeepSeek-V3 models (fp32, aux loss on, AdamW so the optimizer state
matters) in phases: a phase loads the previous phase's checkpoint (into a model whose weights were halved, so only
the checkpoint can bring them back), trains some steps under one plugin and saves. The reference is one uninterrupted
single-process run computed in the same test with the same data-parallel semantics per step (each rank's rows with
their own aux loss, the mean of the ranks' losses), so a resumed run must match it: rank 0's loss every step
(1e-4 relative) and, through `from_pretrained` of every saved folder, every parameter (1e-4 relative, and the
absolute bound of `tiny_model_adam_tolerance`: AdamW runs at TEST_ADAM_EPS, so its step is a smooth function of
the gradient and layouts differ by rounding alone), and the saved Adam moments by name. bf16 / fp16 with fp32
masters round-trip bit for bit across ep sizes. Then the clear errors: a checkpoint of another expert count refused
by name for the model and the optimizer; `cx-train --plugin moe_hybrid --ep 2`; and pipeline stages x experts,
through the plugin and on a test-local composition.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn

from cx_checkpoint import (
    CheckpointKind,
    CheckpointReader,
    TensorMismatchError,
    optimizer_tensor_name,
    read_optimizer_meta,
)
from cx_mesh.testing import TEST_ADAM_EPS, distributed, run_distributed, tiny_model_adam_tolerance
from cx_moe import get_moe_info
from cx_plugins import (
    Booster,
    GeminiPlugin,
    HybridParallelModule,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer
from cx_shardformer import ShardConfig, ShardFormer, get_shard_spec
from cx_shardformer.policies import MixtralForCausalLMPolicy
from hybrid_ckpt_helpers import StagedModel, TorchFace, as_optimizer

transformers = pytest.importorskip("transformers")

VOCAB, ROWS, LENGTH, LR = 50, 4, 8, 1e-2
# AdamW at TEST_ADAM_EPS: layouts differ by rounding alone, bounded for the tests' runs of up to 6 steps
RTOL, ATOL = 1e-4, tiny_model_adam_tolerance(LR, steps=6, tokens=ROWS * LENGTH)
TIMEOUT = 300.0  # seconds per distributed phase: four ranks on a shared two-core machine can take minutes to start


def mixtral(experts: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=experts, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def qwen3_moe() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.Qwen3MoeForCausalLM(config)
    return model


def deepseek_v3() -> nn.Module:
    """A dense first layer, then MoE layers with a shared expert and the sigmoid router's correction bias buffer."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.DeepseekV3ForCausalLM(config)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}
LOADERS: dict[str, Any] = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _moe(ep: int, zero: int, tp: int = 1, **options: Any) -> Callable[[], Plugin]:
    return lambda: MoeHybridParallelPlugin(
        tp_size=tp, pp_size=1, ep_size=ep, precision="fp32", zero_stage=zero, **options
    )


def _pipelined(ep: int, zero: int) -> Callable[[], Plugin]:
    """pp 2, one micro-batch per step (so a step's loss is the reference's per-piece loss, aux loss included)."""
    return lambda: MoeHybridParallelPlugin(
        tp_size=1, pp_size=2, ep_size=ep, precision="fp32", zero_stage=zero, num_microbatches=1
    )


def _expert_tp() -> Plugin:
    policy = MixtralForCausalLMPolicy(expert_tensor_parallel=True)
    return MoeHybridParallelPlugin(
        tp_size=2, pp_size=1, ep_size=2, precision="fp32", zero_stage=2, custom_policy=policy
    )


PLUGINS: dict[str, Callable[[], Plugin]] = {
    "ep2_zero0": _moe(2, 0),
    "ep2_zero1": _moe(2, 1),
    "ep2_zero2": _moe(2, 2),
    "ep1_zero0": _moe(1, 0),
    "ep1_zero2": _moe(1, 2),
    "moe_dp2_ep2_zero1": _moe(2, 1),  # on four ranks
    "moe_dp2_inside_ep2_zero2": _moe(2, 2, moe_dp_outside=False),  # on four ranks: (pp, moe_dp, ep, tp, sp)
    "tp2_ep2_zero0": _moe(2, 0, tp=2),  # on four ranks
    "tp2_ep2_expert_tp_zero2": _expert_tp,  # on four ranks: experts split over tp as well
    "pp2_zero0": _pipelined(1, 0),
    "pp2_ep2_zero1": _pipelined(2, 1),  # on four ranks
    "gemini": lambda: GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 1024}),
    "low_level_zero": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
    "torch_ddp": lambda: TorchDDPPlugin(),
    "torch_fsdp": lambda: TorchFSDPPlugin(),
}


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(100 + step))


@dataclass(frozen=True)
class Phase:
    """Train steps [start, stop) under `plugin` on `world` ranks, after loading the checkpoint at `start` (when
    start > 0), then save (model and optimizer) at `stop`."""

    plugin: str
    start: int
    stop: int
    world: int = 2


def _folder(directory: str, step: int) -> Path:
    return Path(directory, f"step{step}")


def _run_phase(rank: int, world_size: int, model: str, phase: Phase, directory: str) -> None:
    plugin = PLUGINS[phase.plugin]()
    module = MODELS[model]()
    if phase.start > 0:
        with torch.no_grad():  # another starting point: only the checkpoint can bring it back
            for param in module.parameters():
                param.mul_(0.5)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(module, torch.optim.AdamW(module.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    if isinstance(plugin, MoeHybridParallelPlugin) and plugin.ep_size > 1:
        assert isinstance(boosted, HybridParallelModule)
        split = [n for n, p in boosted.unwrap().named_parameters() if get_moe_info(p) is not None]
        fused = [n for n, _ in boosted.unwrap().named_parameters() if n.endswith(_FUSED)]
        assert split == fused, f"the experts of every MoE layer are split over ep: {split}"
        over_tp = [n for n, p in boosted.unwrap().named_parameters() if n in split and get_shard_spec(p) is not None]
        assert over_tp == (split if "expert_tp" in phase.plugin else []), over_tp
    if phase.start > 0:
        source = _folder(directory, phase.start)
        booster.load_model(boosted, source / "model")
        booster.load_optimizer(optimizer, source / "optimizer")
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()  # type: ignore[attr-defined]
    share = ROWS // dp_size
    losses = []
    pipelined = isinstance(plugin, MoeHybridParallelPlugin) and plugin.pp_size > 1
    for step in range(phase.start, phase.stop):
        mine = rows(step)[dp_rank * share : (dp_rank + 1) * share]
        loss: torch.Tensor | None
        if pipelined:  # the last stage has the loss
            batch = iter([{"input_ids": mine, "labels": mine}])
            loss = booster.execute_pipeline(batch, boosted, _model_loss, optimizer, return_loss=True)["loss"]
        else:
            loss = boosted(input_ids=mine, labels=mine).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    target = _folder(directory, phase.stop)
    booster.save_model(boosted, target / "model", shard=True, use_safetensors=True)
    booster.save_optimizer(optimizer, target / "optimizer", shard=True)
    if (rank == 0 and not pipelined) or (pipelined and dp_rank == 0 and losses):
        (target / "losses.json").write_text(json.dumps({"dp": dp_size, "losses": losses}))
    dist.barrier()


def _model_loss(outputs: Any, _micro_batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


def _dp_size(phase: Phase) -> int:
    """The data-parallel size of a phase (every plugin here splits the rows over all ranks but tp and pp)."""
    return phase.world // 2 if phase.plugin.startswith(("tp2", "pp2")) else phase.world


def reference(model: str, phases: list[Phase]) -> tuple[dict[int, dict[str, Any]], list[float]]:
    """The uninterrupted run: per step, the mean of the dp pieces' losses (each with its own aux loss) of that
    step's phase. Returns the snapshots (parameters, Adam state by name) at each phase's end and rank 0's losses."""
    module = MODELS[model]()
    optimizer = torch.optim.AdamW(module.named_parameters(), lr=LR, eps=TEST_ADAM_EPS)
    snapshots: dict[int, dict[str, Any]] = {}
    losses = []
    for phase in phases:
        dp = _dp_size(phase)
        share = ROWS // dp
        for step in range(phase.start, phase.stop):
            ids = rows(step)
            pieces = [module(input_ids=ids[r * share : (r + 1) * share], labels=ids[r * share : (r + 1) * share]).loss
                      for r in range(dp)]  # fmt: skip
            sum(pieces).div(dp).backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(pieces[0].detach()))
        names = [n for n, _ in module.named_parameters()]
        state = optimizer.state_dict()["state"]
        snapshots[phase.stop] = {
            "params": {n: p.detach().clone() for n, p in module.named_parameters()},
            "state": {names[i]: {k: v.clone() for k, v in entry.items()} for i, entry in state.items()},
        }
    return snapshots, losses


def check_saved(model: str, folder: Path, expected: dict[str, Any]) -> None:
    """`from_pretrained` of the saved model folder (sharded safetensors + index) against the reference parameters,
    and the saved Adam moments (full expert stacks by name) against the reference optimizer's."""
    assert (folder / "model" / "model.safetensors.index.json").is_file(), sorted((folder / "model").iterdir())
    loaded, info = getattr(transformers, LOADERS[model]).from_pretrained(
        folder / "model", local_files_only=True, output_loading_info=True
    )
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), info
    params = dict(loaded.named_parameters())
    assert sorted(params) == sorted(expected["params"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(params[name].detach(), value, rtol=RTOL, atol=ATOL, msg=f"{folder}: {name}")
    fused = [n for n in params if n.endswith(_FUSED)]
    assert fused, "the experts are saved under transformers' fused names"
    assert all(params[n].shape[0] == 4 for n in fused), "full expert stacks under the HF names"
    with CheckpointReader.open(folder / "optimizer", CheckpointKind.OPTIMIZER) as reader:
        for name, entries in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                saved = reader.read(optimizer_tensor_name(name, key))
                torch.testing.assert_close(
                    saved, entries[key], rtol=RTOL, atol=1e-7, msg=f"{folder}: state of {name}.{key}"
                )


def run_phases(model: str, phases: list[Phase], directory: Path) -> None:
    for phase in phases:
        run_distributed(_run_phase, phase.world, timeout=TIMEOUT, model=model, phase=phase, directory=str(directory))
    snapshots, losses = reference(model, phases)
    got: list[float] = []
    for phase in phases:
        record = json.loads((_folder(str(directory), phase.stop) / "losses.json").read_text())
        assert record["dp"] == _dp_size(phase), phase
        got += record["losses"]
        check_saved(model, _folder(str(directory), phase.stop), snapshots[phase.stop])
    torch.testing.assert_close(torch.tensor(got), torch.tensor(losses), rtol=RTOL, atol=RTOL / 10)


# ---- saving: from_pretrained equality -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "plugin"),
    [("mixtral", "ep2_zero0"), ("mixtral", "ep2_zero1"), ("qwen3_moe", "ep2_zero2"), ("deepseek_v3", "ep2_zero1")],
)
def test_plugins_moe_checkpoint_ep2_saves_hf_folder(tmp_path: Path, model: str, plugin: str) -> None:
    """ep 2 at zero 0/1/2: the saved folder loads with transformers' class and equals the single-process model,
    the optimizer holds the full fp32 Adam moments by name."""
    run_phases(model, [Phase(plugin, 0, 2)], tmp_path)


# ---- resharding and resuming ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "saver", "loader"),
    [
        ("mixtral", "ep2_zero1", "ep1_zero2"),
        ("mixtral", "ep1_zero0", "ep2_zero2"),
        ("qwen3_moe", "ep2_zero2", "ep1_zero0"),
        ("mixtral", "low_level_zero", "ep2_zero0"),
        ("mixtral", "ep2_zero0", "torch_ddp"),
        ("mixtral", "ep2_zero1", "low_level_zero"),
        ("mixtral", "ep2_zero2", "torch_fsdp"),
    ],
)
def test_plugins_moe_checkpoint_resume_across_layouts(tmp_path: Path, model: str, saver: str, loader: str) -> None:
    """Saved at one ep size (or by another plugin), resumed at another: training continues as uninterrupted."""
    run_phases(model, [Phase(saver, 0, 2), Phase(loader, 2, 4)], tmp_path)


def test_plugins_moe_checkpoint_pipeline_resumes_across_layouts(tmp_path: Path) -> None:
    """Pipeline stages with experts: ep 2 -> pp 2 (ep 1) -> pp 2 x ep 2 (four ranks, ZeRO-1) -> ep 2, each phase's
    folder equal to one process's model and Adam state, the losses those of the uninterrupted run."""
    phases = [
        Phase("ep2_zero2", 0, 2),
        Phase("pp2_zero0", 2, 4),
        Phase("pp2_ep2_zero1", 4, 6, world=4),
        Phase("ep2_zero0", 6, 8),
    ]
    run_phases("mixtral", phases, tmp_path)


def test_plugins_moe_checkpoint_ep2_ep1_gemini(tmp_path: Path) -> None:
    """The issue's chain: ep 2 -> ep 1 -> GeminiPlugin, two steps each."""
    run_phases("mixtral", [Phase("ep2_zero2", 0, 2), Phase("ep1_zero0", 2, 4), Phase("gemini", 4, 6)], tmp_path)


def test_plugins_moe_checkpoint_four_ranks(tmp_path: Path) -> None:
    """moe_dp 2 x ep 2 (ZeRO-1: expert slices sharded over moe_dp, dense over all four) saves; tp 2 x ep 2 with the
    experts split over tp as well (`expert_tensor_parallel=True`, ZeRO-2) resumes and saves; tp 2 x ep 2 (experts
    whole over tp) resumes and saves; moe_dp 2 x ep 2 with moe_dp inside (ZeRO-2) resumes."""
    phases = [
        Phase("moe_dp2_ep2_zero1", 0, 2, world=4),
        Phase("tp2_ep2_expert_tp_zero2", 2, 4, world=4),
        Phase("tp2_ep2_zero0", 4, 6, world=4),
        Phase("moe_dp2_inside_ep2_zero2", 6, 8, world=4),
    ]
    run_phases("mixtral", phases, tmp_path)


# ---- clear errors ---------------------------------------------------------------------------------------------------
@distributed(world_size=2)
def test_plugins_moe_checkpoint_mismatch_is_named(rank: int, world_size: int, tmp_path: Path) -> None:
    """A checkpoint of a model with another expert count loads into neither the model nor the optimizer: an error
    naming the expert tensor, on every rank (no hang)."""
    folder = tmp_path / "eight"
    booster = Booster(plugin=_moe(2, 1)())
    eight = mixtral(experts=8)
    boosted, optimizer, *_ = booster.boost(eight, torch.optim.AdamW(eight.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    booster.backward(boosted(input_ids=rows(0)[:2], labels=rows(0)[:2]).loss, optimizer)
    optimizer.step()
    booster.save_model(boosted, folder / "model", shard=True, use_safetensors=True)
    booster.save_optimizer(optimizer, folder / "optimizer", shard=True)

    other = Booster(plugin=_moe(2, 0)())  # zero 0: the torch optimizer itself would not check shapes
    four = mixtral(experts=4)
    boosted4, optimizer4, *_ = other.boost(four, torch.optim.AdamW(four.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer4 is not None
    with pytest.raises(TensorMismatchError, match=r"mlp\.experts\.gate_up_proj") as model_error:
        other.load_model(boosted4, folder / "model")
    with pytest.raises(ValueError, match=r"mlp\.") as optimizer_error:
        other.load_optimizer(optimizer4, folder / "optimizer")
    assert "is [8, 16, 16] float32 in the checkpoint but the model expects [4, 16, 16]" in str(model_error.value)
    assert "does not fit the parameter" in str(optimizer_error.value)
    dist.barrier()


@distributed(world_size=2)
def test_plugins_moe_checkpoint_unequal_state_is_named(rank: int, world_size: int, tmp_path: Path) -> None:
    """An ep rank whose optimizer lacks an expert slice's state cannot pair its gathers with the other's: the save
    is refused by name on every rank before any gather (no hang, no file)."""
    booster = Booster(plugin=_moe(2, 0)())
    module = mixtral()
    boosted, optimizer, *_ = booster.boost(module, torch.optim.AdamW(module.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert isinstance(optimizer, HybridParallelOptimizer)
    assert isinstance(boosted, HybridParallelModule)
    booster.backward(boosted(input_ids=rows(0)[:2], labels=rows(0)[:2]).loss, optimizer)
    optimizer.step()
    if rank == 1:
        working = dict(boosted.unwrap().named_parameters())["model.layers.0.mlp.experts.down_proj"]
        optimizer.optim.state.pop(optimizer.get_working_to_master_map()[id(working)])
    with pytest.raises(Exception, match=r"first difference at model\.layers\.0\.mlp\.experts\.down_proj"):
        booster.save_optimizer(optimizer, tmp_path / "optimizer", shard=True)
    dist.barrier()
    assert not (tmp_path / "optimizer").exists()


# ---- cx-train ------------------------------------------------------------------------------------------------------
DEMO = ["--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--hidden-size", "32", "--log-every", "100"]
MOE_DEMO = ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "2"]


@distributed(world_size=2)
def test_plugins_moe_checkpoint_demo_resumes_exactly(rank: int, world_size: int, tmp_path: Path) -> None:
    """`cx-train --plugin moe_hybrid --ep 2`: 2 steps saved + 2 resumed give the losses of 4 straight steps, resumed
    at ep 2, at ep 1 and under GeminiPlugin (the same two data-parallel ranks each time)."""
    from cx_plugins.demo import parse_options
    from cx_plugins.demo._train import run

    checkpoint = str(tmp_path / "ckpt")
    straight = run(parse_options([*DEMO, *MOE_DEMO, "--steps", "4"]))
    first = run(parse_options([*DEMO, *MOE_DEMO, "--steps", "2", "--save", checkpoint]))
    rest = run(parse_options([*DEMO, *MOE_DEMO, "--steps", "4", "--resume", checkpoint]))
    ep1 = ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "1"]
    rest_ep1 = run(parse_options([*DEMO, *ep1, "--steps", "4", "--resume", checkpoint]))
    gemini = ["--model", "mixtral", "--plugin", "gemini"]
    rest_gemini = run(parse_options([*DEMO, *gemini, "--steps", "4", "--resume", checkpoint]))
    for resumed in (rest, rest_ep1, rest_gemini):
        assert (len(first), len(resumed)) == (2, 2)
        torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(straight), rtol=RTOL, atol=RTOL / 10)


def test_plugins_moe_checkpoint_demo_command_line(tmp_path: Path) -> None:
    """The command line itself: `--save` and then `--resume` with --ep 2 (refused before MoE checkpoints existed);
    the saved model folder loads with MixtralForCausalLM."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    checkpoint = tmp_path / "ckpt"

    def cx_train(*flags: str) -> str:
        command = [sys.executable, "-m", "cx_plugins.demo", *DEMO, *MOE_DEMO, *flags]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result.stdout

    assert f"saved step 2 to {checkpoint}" in cx_train("--steps", "2", "--save", str(checkpoint))
    assert f"resumed from {checkpoint} at step 2" in cx_train("--steps", "3", "--resume", str(checkpoint))
    _, info = transformers.MixtralForCausalLM.from_pretrained(
        str(checkpoint / "model"), local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info


# ---- mixed precision: fp32 masters round-trip ----------------------------------------------------------------------
def _round_trip_phase(
    rank: int, world_size: int, precision: str, ep: int, zero: int, source: str | None, target: str
) -> None:
    """`precision` at `ep` / `zero`: train two steps (or load `source`), then save the model (sharded and one file)
    and the optimizer to `target`."""
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=ep, precision=precision, zero_stage=zero)
    module = mixtral()
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(module, torch.optim.AdamW(module.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    if source is None:
        dp_rank, dp_size = plugin.data_parallel_rank_and_size()
        share = ROWS // dp_size
        for step in range(2):
            mine = rows(step)[dp_rank * share : (dp_rank + 1) * share]
            booster.backward(boosted(input_ids=mine, labels=mine).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
    else:
        booster.load_model(boosted, Path(source, "model"))
        booster.load_optimizer(optimizer, Path(source, "optimizer"))
    booster.save_model(boosted, Path(target, "model"), shard=True, use_safetensors=True)
    booster.save_model(boosted, Path(target, "single", "model.safetensors"), shard=False, use_safetensors=True)
    booster.save_optimizer(optimizer, Path(target, "optimizer"), shard=True)
    booster.save_optimizer(optimizer, Path(target, "single", "optimizer.safetensors"), shard=False)
    dist.barrier()


def _tensors(folder: Path, kind: CheckpointKind) -> dict[str, torch.Tensor]:
    with CheckpointReader.open(folder, kind) as reader:
        return {name: reader.read(name).clone() for name in reader.names()}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_plugins_moe_checkpoint_mixed_precision_round_trip(tmp_path: Path, precision: str) -> None:
    """bf16 / fp16 with fp32 masters: saved at ep 2 (ZeRO-1), loaded at ep 1 (zero 0) and saved again, every tensor
    of the model and of the optimizer (the fp32 `master_weight` of each full expert stack included) and the param
    groups with the loss scaler come back bit for bit; the one-file saves (model, optimizer) hold the
    same tensors as the sharded ones."""
    first, second = tmp_path / "ep2", tmp_path / "ep1"
    run_distributed(_round_trip_phase, 2, precision=precision, ep=2, zero=1, source=None, target=str(first))
    run_distributed(_round_trip_phase, 2, precision=precision, ep=1, zero=0, source=str(first), target=str(second))
    for folder in (first, second):
        sharded = _tensors(folder / "model", CheckpointKind.MODEL)
        single = load_file(str(folder / "single" / "model.safetensors"))
        assert sorted(single) == sorted(sharded)
        for name, tensor in sharded.items():
            assert torch.equal(single[name], tensor), name
        sharded = _tensors(folder / "optimizer", CheckpointKind.OPTIMIZER)
        single = _tensors(folder / "single" / "optimizer.safetensors", CheckpointKind.OPTIMIZER)
        assert sorted(single) == sorted(sharded)
        for name, tensor in sharded.items():
            assert torch.equal(single[name], tensor), name
    model1, model2 = _tensors(first / "model", CheckpointKind.MODEL), _tensors(second / "model", CheckpointKind.MODEL)
    assert model1["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 16, 16)
    assert model1["model.layers.0.mlp.experts.gate_up_proj"].dtype == torch.float32, "saved in the model's own dtype"
    optim1 = _tensors(first / "optimizer", CheckpointKind.OPTIMIZER)
    optim2 = _tensors(second / "optimizer", CheckpointKind.OPTIMIZER)
    master = optim1[optimizer_tensor_name("model.layers.1.mlp.experts.down_proj", "master_weight")]
    assert (master.shape, master.dtype) == ((4, 16, 8), torch.float32)
    groups = []
    for folder in (first, second):
        with CheckpointReader.open(folder / "optimizer", CheckpointKind.OPTIMIZER) as reader:
            groups.append(read_optimizer_meta(reader).param_groups)
    assert groups[0] == groups[1]
    for saved, again in ((model1, model2), (optim1, optim2)):
        assert sorted(saved) == sorted(again)
        for name, tensor in saved.items():
            assert torch.equal(again[name], tensor), name


# ---- pipeline stages x experts on a test-local composition (ShardFormer, split_model and AdamW by hand) ------------
def _staged(layout: ParallelLayout, scale: float) -> tuple[StagedModel, TorchFace, HybridCheckpointIO]:
    """Mixtral made expert-parallel by ShardFormer over the layout's ep group, then split into its pipeline stages,
    with AdamW over the stage's parameters stepped once with gradient = the full parameter's value (so every expert's
    state differs), weights times `scale`."""
    module = mixtral()
    with torch.no_grad():
        grads = {n: p.detach().clone() for n, p in module.named_parameters()}
        for param in module.parameters():
            param.mul_(scale)
    config = ShardConfig(
        enable_tensor_parallelism=False, ep_group=layout.group(Axis.EP), moe_dp_group=layout.group(Axis.MOE_DP)
    )
    ShardFormer(config).optimize(module)
    view = StagedModel(module, layout, "mixtral")
    face = TorchFace(view)
    for name, param in module.named_parameters():
        if name in view.held_parameter_names():
            info = get_moe_info(param)
            rows_ = slice(None) if info is None else slice(info.local_experts.start, info.local_experts.stop)
            param.grad = grads[name][rows_].clone()
    face.step()

    def parts_of(opt: object) -> tuple[ParallelModelView, ParallelOptimizerView] | None:
        return (view, cast(ParallelOptimizerView, face)) if opt is face else None

    return view, face, HybridCheckpointIO(parts_of)


@distributed(world_size=4, timeout=TIMEOUT)
def test_plugins_moe_checkpoint_pipeline_stages_with_experts(rank: int, world_size: int, tmp_path: Path) -> None:
    """pp 2 x ep 2: each stage gathers its own layers' experts over ep; the folder equals one process's model and
    AdamW state (from_pretrained, moments by name). Loaded at ep 4 (one expert per rank, no pipeline) from halved
    weights and saved again: every tensor comes back bit for bit."""
    first, second = tmp_path / "pp2_ep2", tmp_path / "ep4"
    layout = ParallelLayout.build(
        [(Axis.MOE_DP, FILL), (Axis.PP, 2), (Axis.EP, 2), (Axis.TP, 1)], data_axes=(Axis.MOE_DP, Axis.EP)
    )
    view, face, io = _staged(layout, 1.0)
    assert view.pipeline is not None
    assert len(view.held_parameter_names()) < len(dict(view.module.named_parameters())), "a stage holds a part"
    io.save_model(view, first / "model", shard=True, use_safetensors=True)
    io.save_optimizer(as_optimizer(face), first / "optimizer", shard=True)

    flat = ParallelLayout.build(
        [(Axis.MOE_DP, FILL), (Axis.PP, 1), (Axis.EP, 4), (Axis.TP, 1)], data_axes=(Axis.MOE_DP, Axis.EP)
    )
    view4, face4, io4 = _staged(flat, 0.5)
    io4.load_model(view4, first / "model")
    io4.load_optimizer(as_optimizer(face4), first / "optimizer")
    io4.save_model(view4, second / "model", shard=True, use_safetensors=True)
    io4.save_optimizer(as_optimizer(face4), second / "optimizer", shard=True)
    dist.barrier()
    if rank == 0:
        reference = mixtral()
        optimizer = torch.optim.AdamW(reference.named_parameters(), lr=LR, eps=TEST_ADAM_EPS)
        for param in reference.parameters():
            param.grad = param.detach().clone()
        optimizer.step()
        names = [n for n, _ in reference.named_parameters()]
        expected = {
            "params": {n: p.detach().clone() for n, p in reference.named_parameters()},
            "state": {names[i]: entry for i, entry in optimizer.state_dict()["state"].items()},
        }
        check_saved("mixtral", first, expected)
        for kind, part in ((CheckpointKind.MODEL, "model"), (CheckpointKind.OPTIMIZER, "optimizer")):
            saved, again = _tensors(first / part, kind), _tensors(second / part, kind)
            assert sorted(saved) == sorted(again)
            for name, tensor in saved.items():
                assert torch.equal(again[name], tensor), name
    dist.barrier()
