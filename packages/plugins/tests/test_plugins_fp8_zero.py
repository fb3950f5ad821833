"""use_fp8 and fp8_communication under LowLevelZeroPlugin (stages 1 and 2) and GeminiPlugin (also with tp_size 2): a
tiny HF Llama trains 30 steps in bf16 with each switch, its mean loss over the last 10 steps within 3% of the bf16 run's
(the issue's figure for fp8 training), the switch really runs in fp8 (Fp8Linear layers, or fewer bytes through the
collectives: exactly half the bf16 payload bytes plus one scale a message), the parameters every rank computes with are
identical, and every parameter after the first step is within AdamW's bound of the bf16 run's (fp8_test_helpers; same
direction as bf16 for 97.0% of the elements with use_fp8, 94.3% (LowLevelZero) and 92.7% (Gemini) with
fp8_communication, whose fp8 parameter all-gather rounds the smallest moves away, 96.2% at tp 2; measured, no floor
asserted).
Skipped when transformers is not installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.fp8 import Fp8Linear, ScalingRecipe
from cx_mesh.testing import CollectiveBytes, count_collective_bytes, distributed
from cx_plugins import Booster, GeminiPlugin, LowLevelZeroPlugin
from cx_plugins._plugin import Plugin
from fp8_test_helpers import assert_first_step_within_adam, assert_fp8_bytes

transformers = pytest.importorskip("transformers")

STEPS, VOCAB, PER_RANK, LENGTH, LR = 30, 128, 2, 16, 3e-3
LAST = 10  # losses compared: the mean of the last LAST steps (one step's loss moves with its batch)


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=LENGTH, num_hidden_layers=2, use_cache=False, attention_dropout=0.0,
    )  # fmt: skip
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _plugin(
    family: str, use_fp8: bool, fp8_communication: bool, recipe: ScalingRecipe = ScalingRecipe.TENSORWISE
) -> Plugin:
    if family.startswith("gemini"):  # small chunks: the model spans several, each sharded over the zero group
        return GeminiPlugin(
            precision="bf16",
            chunk_config_dict={"chunk_size": 16 * 1024},
            tp_size=2 if family == "gemini_tp2" else 1,
            use_fp8=use_fp8,
            fp8_communication=fp8_communication,
            fp8_recipe=recipe,
        )
    stage = int(family[-1])
    return LowLevelZeroPlugin(
        stage=stage, precision="bf16", use_fp8=use_fp8, fp8_communication=fp8_communication, fp8_recipe=recipe
    )


@dataclass
class _Run:
    losses: list[float]
    model: nn.Module
    sent: CollectiveBytes  # what this rank handed to collectives while training
    weights: list[torch.Tensor]  # what each plain Linear computed with in the last forward
    start: dict[str, torch.Tensor]  # every parameter the first forward computed with (this rank's TP shard)
    first: dict[str, torch.Tensor]  # ... and the second: the parameters after the first optimizer step

    def tail(self) -> float:
        return sum(self.losses[-LAST:]) / LAST


def _train(
    rank: int,
    family: str,
    use_fp8: bool = False,
    fp8_communication: bool = False,
    recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
) -> _Run:
    """Train STEPS steps; the weights are captured by pre-hooks that run after the plugin's own gathers."""
    model = _llama()
    booster = Booster(plugin=_plugin(family, use_fp8, fp8_communication, recipe))
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR))
    assert optimizer is not None
    seen: dict[str, torch.Tensor] = {}

    def record(name: str) -> Any:
        def hook(module: nn.Module, _args: Any) -> None:
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            seen[name] = weight.detach().float().clone()

        return hook

    params: dict[str, torch.Tensor] = {}

    def record_all(name: str) -> Any:
        def hook(module: nn.Module, _args: Any) -> None:
            for own, param in module.named_parameters(recurse=False):
                params[f"{name}.{own}"] = param.detach().clone()

        return hook

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(record(name))
        if next(module.parameters(recurse=False), None) is not None:
            module.register_forward_pre_hook(record_all(name))
    batches = torch.randint(0, VOCAB, (4, 2 * PER_RANK, LENGTH), generator=torch.Generator().manual_seed(7))
    # every family trains on the same global batch of 2 * PER_RANK rows; tp 2 on 2 ranks is one data-parallel
    # replica, which takes all of it (with half of it, its noisier curves put the fp8 run a fraction of a pass
    # behind bf16's on a loss falling ~15% a pass: 3.4% apart at the tail, against 0.4% on the full batch)
    rows = slice(None) if family == "gemini_tp2" else slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses: list[float] = []
    start: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    with count_collective_bytes() as counted:
        for step in range(STEPS):
            mine = batches[step % 4][rows]
            loss = boosted(input_ids=mine, labels=mine).loss
            if step < 2:  # the first forward computes with the initial parameters, the second with the stepped ones
                (start if step == 0 else first).update(params)
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        boosted(input_ids=mine, labels=mine)  # gathers the parameters of the last step for the hooks
    return _Run(losses, model, counted, [seen[k] for k in sorted(seen)], start, first)


def _same_on_every_rank(tensors: list[torch.Tensor], what: str) -> None:
    for i, tensor in enumerate(tensors):
        theirs = tensor.clone()
        dist.broadcast(theirs, 0)
        assert torch.equal(tensor, theirs), f"{what}: Linear {i} differs from rank 0's"


def _check(run: _Run, baseline: _Run, switch: str, what: str) -> None:
    """Loss within 3% of bf16's; the parameters after the first step within AdamW's bound of bf16's; the switch
    really ran in fp8; every rank computed with the same weights."""
    # fp8_communication all-gathers the updated parameters in fp8: the weights computed with carry E4M3's rounding
    assert_first_step_within_adam(baseline.start, baseline.first, run.first, LR, switch == "fp8_communication")
    assert run.tail() == pytest.approx(baseline.tail(), rel=0.03), f"{what}: {run.tail()} vs bf16 {baseline.tail()}"
    converted = sorted(n for n, m in run.model.named_modules() if isinstance(m, Fp8Linear))
    if switch == "use_fp8":  # every projection of both layers (64x64, 64x128, 128x64); lm_head stays bf16
        assert len(converted) == 2 * 7, converted
        assert "lm_head" not in converted
    else:  # payloads as fp8, exactly: half the bf16 bytes plus the scales; the norm's float32 all-reduce unchanged
        assert not converted
        assert_fp8_bytes(baseline.sent, run.sent, dist.get_world_size())
    _same_on_every_rank(run.weights, what)


@distributed(world_size=2, timeout=600)  # a hang guard only: a few short runs per case, on shared cores
@pytest.mark.parametrize("plugin", ["low_level_zero", "gemini"])
def test_plugins_fp8_zero_switches_train_like_bf16(rank: int, world_size: int, plugin: str) -> None:
    """LowLevelZero's stages 1 and 2 share one bf16 baseline: their reductions are bit-identical (docs/zero.md)."""
    families = ["zero1", "zero2"] if plugin == "low_level_zero" else ["gemini"]
    baseline = _train(rank, families[0])
    assert baseline.tail() < 0.8 * sum(baseline.losses[:LAST]) / LAST, "bf16 must learn for the comparison to mean much"
    for family in families:
        for switch in ("use_fp8", "fp8_communication"):
            run = _train(rank, family, switch == "use_fp8", switch == "fp8_communication")
            _check(run, baseline, switch, f"{family} {switch}")


@distributed(world_size=2, timeout=600)
def test_plugins_fp8_zero_blockwise_recipe_trains_like_bf16(rank: int, world_size: int) -> None:
    """LowLevelZeroPlugin(stage=2, use_fp8=True, fp8_recipe=BLOCKWISE): every converted layer computes with
    DeepSeek-V3's 1x128 / 128x128 tiles (here each tile is a remainder: the dims are 64 and 128 wide), and training
    meets the same bars as the default recipe: tail loss within 3% of bf16's, the first step within AdamW's bound.
    The same with GeminiPlugin(tp_size=2), whose TP layers take the recipe from ShardFormer."""
    baseline = _train(rank, "zero2")
    run = _train(rank, "zero2", use_fp8=True, recipe=ScalingRecipe.BLOCKWISE)
    _check(run, baseline, "use_fp8", "zero2 use_fp8 blockwise")
    recipes = {m.recipe for m in run.model.modules() if isinstance(m, Fp8Linear)}
    assert recipes == {ScalingRecipe.BLOCKWISE}, recipes
    # GeminiPlugin(tp_size=2): the recipe reaches ShardFormer's tensor-parallel layers (ShardConfig.fp8_options)
    baseline = _train(rank, "gemini_tp2")
    run = _train(rank, "gemini_tp2", use_fp8=True, recipe=ScalingRecipe.BLOCKWISE)
    assert_first_step_within_adam(baseline.start, baseline.first, run.first, LR)
    assert run.tail() == pytest.approx(baseline.tail(), rel=0.03), (run.tail(), baseline.tail())
    marks = [getattr(m, "fp8_recipe", None) for m in run.model.modules()]
    assert marks.count(ScalingRecipe.BLOCKWISE) == 2 * 7, marks


@distributed(world_size=2, timeout=600)
def test_plugins_fp8_gemini_tp_hands_the_switches_to_shardformer(rank: int, world_size: int) -> None:
    """GeminiPlugin(tp_size=2): ShardFormer's tensor-parallel layers take use_fp8 and fp8_communication (every
    projection is one of them, so no plain Linear is left to convert) and training stays within 3% of bf16's."""
    baseline = _train(rank, "gemini_tp2")
    run = _train(rank, "gemini_tp2", use_fp8=True, fp8_communication=True)
    assert_first_step_within_adam(baseline.start, baseline.first, run.first, LR)
    assert run.tail() == pytest.approx(baseline.tail(), rel=0.03), (run.tail(), baseline.tail())
    in_fp8 = [m for m in run.model.modules() if getattr(m, "fp8_recipe", None) is not None]  # ShardFormer's mark
    assert len(in_fp8) == 2 * 7  # each rank's shards are 32 or 64 wide: all eligible
    assert all(getattr(m, "fp8_communication", False) for m in in_fp8)
    # exactly: the TP all-reduces as fp8 reduce-scatter + all-gather; the vocab-parallel cross entropy's float32
    # reductions as they were. Gemini's data-parallel group is one rank here: the bf16 run hands each chunk to a
    # one-rank reduce-scatter (nothing moves), which the fp8 collectives skip for a local copy
    one_rank = ("reduce_scatter_single", torch.bfloat16)
    assert one_rank not in run.sent.by_dtype
    del baseline.sent.by_dtype[one_rank], baseline.sent.calls[one_rank]
    assert_fp8_bytes(baseline.sent, run.sent, world_size)


@distributed(world_size=1)
def test_plugins_fp8_zero_warns_when_no_layer_can_be_fp8(rank: int, world_size: int) -> None:
    """use_fp8=True on a model with no eligible Linear (7 and 5 features: not multiples of 16) says so."""
    for plugin in (LowLevelZeroPlugin(precision="bf16", use_fp8=True), GeminiPlugin(precision="bf16", use_fp8=True)):
        model = nn.Sequential(nn.Linear(7, 5))
        with pytest.warns(UserWarning, match=r"\(use_fp8=True\): no layer was converted to fp8"):
            Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))
        assert not any(isinstance(m, Fp8Linear) for m in model.modules())


@distributed(world_size=1)
def test_plugins_fp8_zero_refuses_a_device_without_fp8_matmuls(rank: int, world_size: int) -> None:
    """A CUDA GPU older than compute capability 8.9 has no fp8 GEMM: boosting fails, naming the switch, rather than
    the first forward (stood in for here by making the capability check say no)."""
    model = nn.Sequential(nn.Linear(32, 32))
    with (
        mock.patch("cx_plugins.fp8._use_fp8.fp8_matmul_supported", return_value=False),
        pytest.raises(ValueError, match=r"GeminiPlugin\(use_fp8=True\): fp8 matmuls do not run on cpu"),
    ):
        Booster(plugin=GeminiPlugin(precision="bf16", use_fp8=True)).boost(model)
