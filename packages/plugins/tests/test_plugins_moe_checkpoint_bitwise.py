"""MoeHybridParallelPlugin checkpoints that come back bit for bit: bf16 / fp16 with fp32 masters saved at ep 2 and
loaded at ep 1, and pipeline stages x experts on a test-local composition (ShardFormer, split_model and AdamW by
hand) saved at pp 2 x ep 2 and loaded at ep 4. The phase-by-phase resumes against a single-process run, the clear
errors and cx-train are in test_plugins_moe_checkpoint.py; the models and `check_saved` in moe_ckpt_helpers.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from cx_checkpoint import CheckpointKind, CheckpointReader, optimizer_tensor_name, read_optimizer_meta
from cx_mesh.testing import TEST_ADAM_EPS, distributed, run_distributed
from cx_moe import get_moe_info
from cx_plugins import Booster, MoeHybridParallelPlugin
from cx_plugins._layout import FILL, Axis, ParallelLayout
from cx_plugins.checkpoint_io._parallel_view import ParallelModelView, ParallelOptimizerView
from cx_plugins.hybrid._checkpoint_io import HybridCheckpointIO
from cx_shardformer import ShardConfig, ShardFormer
from hybrid_ckpt_helpers import StagedModel, TorchFace, as_optimizer
from moe_ckpt_helpers import LR, ROWS, TIMEOUT, check_saved, mixtral, rows

pytest.importorskip("transformers")


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
