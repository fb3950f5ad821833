"""MoeHybridParallelPlugin checkpoints: expert slices gathered over ep (and tp) into transformers 5's fused names and
full shapes, optimizer state by name, loads that reshard.

Each test trains tiny HF Mixtral / Qwen3-MoE / DeepSeek-V3 models (fp32, aux loss on, AdamW so the optimizer state
matters) in phases: a phase loads the previous phase's checkpoint (into a model whose weights were halved, so only
the checkpoint can bring them back), trains some steps under one plugin and saves. The reference is one uninterrupted
single-process run computed in the same test with the same data-parallel semantics per step (each rank's rows with
their own aux loss, the mean of the ranks' losses), so a resumed run must match it: rank 0's loss every step
(1e-4 relative) and, through `from_pretrained` of every saved folder, every parameter (1e-4 relative, and the
absolute bound of `tiny_model_adam_tolerance`: AdamW runs at TEST_ADAM_EPS, so its step is a smooth function of
the gradient and layouts differ by rounding alone), and the saved Adam moments by name; pipeline stages x experts
through the plugin. Then the clear errors: a checkpoint of another expert count refused by name for the model and
the optimizer. (`cx-train --plugin moe_hybrid --ep 2` is tested with cx-train: test_train_moe_checkpoint.py.)

The bit-for-bit round trips (bf16 / fp16 with fp32 masters across ep sizes; pipeline stages x experts on a
test-local composition) are in test_plugins_moe_checkpoint_bitwise.py; the models, the rows, the tolerances and
`check_saved` in moe_ckpt_helpers.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cx_checkpoint import TensorMismatchError
from cx_mesh.testing import TEST_ADAM_EPS, distributed, run_distributed
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
from cx_plugins.hybrid._optimizer import HybridParallelOptimizer
from cx_shardformer import get_shard_spec
from cx_shardformer.policies import MixtralForCausalLMPolicy
from moe_ckpt_helpers import FUSED_EXPERTS, LR, MODELS, ROWS, RTOL, TIMEOUT, check_saved, mixtral, rows

transformers = pytest.importorskip("transformers")


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
        fused = [n for n, _ in boosted.unwrap().named_parameters() if n.endswith(FUSED_EXPERTS)]
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
