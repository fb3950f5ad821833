"""torch.compile's factor and fp8 linear layers in cx-plan's step time (`step_time._kernels`): the arithmetic of the
compute term against its closed form, what they leave alone (collectives, the optimizer step, memory), the flags that
reach them and the errors for what cannot be."""

from __future__ import annotations

import json

import pytest

from cx_plan._candidate import Candidate
from cx_plan._cli import build_parser, main
from cx_plan._devices import lookup_device
from cx_plan.step_time._kernels import COMPILE_SPEEDUP, FP8_GAIN, Kernels
from cx_plan.step_time._step_time import (
    flops_per_token,
    linear_flops_per_token,
    predict_step_time,
    worst_rank_expert_flops,
)
from cx_plan.trace._model_spec import ModelShape, shape_from_config
from cx_plugins.models import GPTConfig
from test_plan_routing_skew import _moe_shape, _stub

_SEQ = 32
_REL = 1e-12  # the same float operations in another order
_H100 = lookup_device("h100")
_GPT_FLAGS = ["--model", "gpt", "--hidden-size", "32", "--num-layers", "2", "--seq-len", "32", "--world", "2"]


@pytest.fixture(scope="module")
def gpt() -> ModelShape:
    return shape_from_config(
        "gpt", GPTConfig(vocab_size=256, max_positions=33, hidden_size=64, num_layers=2, num_heads=4)
    )


def _ddp(checkpoint_ratio: float = 0.0) -> Candidate:
    return Candidate("torch_ddp", dp=2, micro_batch_size=2, precision="bf16", checkpoint_ratio=checkpoint_ratio)


def test_eager_kernels_change_nothing(gpt: ModelShape) -> None:
    assert predict_step_time(_ddp(), gpt, _SEQ, _H100) == predict_step_time(_ddp(), gpt, _SEQ, _H100, kernels=Kernels())


@pytest.mark.parametrize("checkpoint", [0.0, 1.0])
def test_compile_divides_the_compute_and_nothing_else(gpt: ModelShape, checkpoint: float) -> None:
    c = _ddp(checkpoint_ratio=checkpoint)
    eager = predict_step_time(c, gpt, _SEQ, _H100)
    compiled = predict_step_time(c, gpt, _SEQ, _H100, kernels=Kernels(compile_speedup=1.6))
    assert compiled.compute_s == pytest.approx(eager.compute_s / 1.6, rel=_REL)
    assert compiled.recompute_s == pytest.approx(eager.recompute_s / 1.6, rel=_REL)
    assert compiled.communication_s == eager.communication_s
    assert compiled.optimizer_s == eager.optimizer_s


def test_fp8_runs_the_layers_linear_flops_at_the_fp8_rate(gpt: ModelShape) -> None:
    """Compute = tokens / world x (the rest at efficiency x the bf16 peak + the linear FLOPs at fp8_gain x that rate,
    at most efficiency x the fp8 peak); a gain of 1 is the bf16 rate again, a gain above the peaks' ratio (2) caps."""
    c = _ddp()
    per_token, _ = flops_per_token(gpt, _SEQ)
    linear = linear_flops_per_token(c, gpt)
    tokens = c.global_batch_size * _SEQ
    bf16 = 989e12 * 0.45
    expected = tokens / c.world_size * ((per_token - linear) / bf16 + linear / (1.3 * bf16))
    fp8 = predict_step_time(c, gpt, _SEQ, _H100, kernels=Kernels(fp8_gain=1.3))
    assert fp8.compute_s == pytest.approx(expected, rel=_REL)
    eager = predict_step_time(c, gpt, _SEQ, _H100)
    assert predict_step_time(c, gpt, _SEQ, _H100, kernels=Kernels(fp8_gain=1.0)).compute_s == pytest.approx(
        eager.compute_s, rel=_REL
    )
    capped = tokens / c.world_size * ((per_token - linear) / bf16 + linear / (1979e12 * 0.45))
    assert predict_step_time(c, gpt, _SEQ, _H100, kernels=Kernels(fp8_gain=3.0)).compute_s == pytest.approx(
        capped, rel=_REL
    )
    both = predict_step_time(c, gpt, _SEQ, _H100, kernels=Kernels(compile_speedup=1.25, fp8_gain=1.3))
    assert both.compute_s == pytest.approx(expected / 1.25, rel=_REL)


@pytest.mark.parametrize("name", ["h100", "h200", "h100_96gb"])
def test_fp8_keeps_the_fitted_gain_on_every_row(gpt: ModelShape, name: str) -> None:
    """The default gain is over each row's own achieved bf16 rate, so the linear FLOPs run FP8_GAIN x faster on the
    `h100` (SXM, 45 %) and `h200` rows as on the `h100_96gb` row it was fitted on (40 % of 912), not a fitted
    fraction of the fp8 peak that would carry h100_96gb's efficiency to them."""
    c = _ddp()
    device = lookup_device(name)
    per_token, _ = flops_per_token(gpt, _SEQ)
    linear = linear_flops_per_token(c, gpt)
    tokens = c.global_batch_size * _SEQ
    bf16 = device.peak("bf16") * device.efficiency
    eager = predict_step_time(c, gpt, _SEQ, device)
    fp8 = predict_step_time(c, gpt, _SEQ, device, kernels=Kernels(fp8_gain=FP8_GAIN))
    assert eager.compute_s - fp8.compute_s == pytest.approx(
        tokens / c.world_size * (linear / bf16 - linear / (FP8_GAIN * bf16)), rel=1e-9
    )
    assert fp8.compute_s == pytest.approx(
        tokens / c.world_size * ((per_token - linear) / bf16 + linear / (FP8_GAIN * bf16)), rel=1e-9
    )


def test_linear_flops_are_the_layers_matmuls_without_attention_or_head(gpt: ModelShape) -> None:
    per_token, _ = flops_per_token(gpt, _SEQ)
    attention = 12.0 * gpt.num_layers * _SEQ * gpt.num_heads * gpt.head_dim
    head = 6.0 * gpt.vocab_size * gpt.hidden_size
    assert linear_flops_per_token(_ddp(), gpt) == pytest.approx(per_token - attention - head, rel=_REL)


def test_linear_flops_of_moe_count_top_k_experts_and_the_hot_rank() -> None:
    moe = _moe_shape()
    counts = moe.parameters
    balanced = Candidate("moe_hybrid", dp=4, ep=4, precision="bf16")
    routed = counts.experts * 2 / 8
    assert linear_flops_per_token(balanced, moe) == 6.0 * (sum(counts.dense_per_layer) + routed)
    skewed = Candidate("moe_hybrid", dp=4, ep=4, precision="bf16", routing_skew=1.5)
    extra = worst_rank_expert_flops(skewed, moe)
    assert extra > 0
    assert linear_flops_per_token(skewed, moe) == pytest.approx(linear_flops_per_token(balanced, moe) + extra)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compile_speedup": 0.0}, "compile_speedup must be a positive"),
        ({"fp8_gain": 0.0}, "fp8_gain must be a positive"),
    ],
)
def test_kernels_refuse_impossible_factors(changes: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Kernels(**changes)


def test_compute_above_the_peak_and_fp8_without_fp8_matmuls_are_errors(gpt: ModelShape) -> None:
    with pytest.raises(ValueError, match="above the device's peak"):
        predict_step_time(_ddp(), gpt, _SEQ, _H100, efficiency=0.9, kernels=Kernels(compile_speedup=1.2))
    with pytest.raises(ValueError, match="no peak for precision 'fp8'"):
        predict_step_time(_ddp(), gpt, _SEQ, lookup_device("a100"), kernels=Kernels(fp8_gain=1.3))


def test_a_peak_override_keeps_fp8_at_twice_bf16() -> None:
    device = lookup_device("h100", peak_flops=800e12)
    assert device.peak("bf16") == 800e12
    assert device.peak("fp8") == pytest.approx(1600e12, rel=1e-3)  # 1979 / 989


def _compute(flags: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, float]:
    assert main([*_GPT_FLAGS, "--device", "h100", "--plugins", "torch_ddp", "--all", "--json", "--quiet", *flags],
                memory_factory=_stub) == 0  # fmt: skip
    return {row["label"]: row["compute_s"] for row in json.loads(capsys.readouterr().out)["rows"]}


def test_cli_compile_and_fp8_reach_the_step_time(capsys: pytest.CaptureFixture[str]) -> None:
    eager = _compute([], capsys)
    compiled = _compute(["--compile", "--compile-speedup", "1.25"], capsys)
    assert compiled.keys() == eager.keys()
    assert all(compiled[label] == pytest.approx(eager[label] / 1.25, rel=_REL) for label in eager)
    default = _compute(["--compile"], capsys)
    assert all(default[label] == pytest.approx(eager[label] / COMPILE_SPEEDUP, rel=_REL) for label in eager)
    fp8 = _compute(["--fp8"], capsys)  # the default gain is above 1: fp8 is faster
    assert FP8_GAIN > 1
    assert all(fp8[label] < eager[label] for label in eager)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--compile-speedup", "1.2"], "--compile-speedup takes effect only with --compile"),
        (["--fp8-gain", "1.3"], "--fp8-gain takes effect only with --fp8"),
        (["--fp8", "--device", "a100"], "--fp8: device a100 has no fp8 matmuls"),
        (["--compile", "--compile-speedup", "0"], "compile_speedup must be a positive"),
    ],
)
def test_cli_kernel_flag_errors(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*_GPT_FLAGS, *flags], memory_factory=_stub) == 2
    assert message in capsys.readouterr().err


def test_cli_kernel_flags_default_off() -> None:
    args = build_parser().parse_args(_GPT_FLAGS)
    assert (args.compile, args.fp8, args.compile_speedup, args.fp8_gain) == (False, False, None, None)


def test_cli_efficiency_defaults_to_the_device_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --efficiency the compute runs at the device row's fitted fraction (a100: 0.60), not the 0.45 of
    ACHIEVABLE_FRACTION; --efficiency still overrides it."""

    def compute(flags: list[str]) -> dict[str, float]:
        assert main([*_GPT_FLAGS, "--device", "a100", "--plugins", "torch_ddp", "--all", "--json", "--quiet", *flags],
                    memory_factory=_stub) == 0  # fmt: skip
        return {row["label"]: row["compute_s"] for row in json.loads(capsys.readouterr().out)["rows"]}

    row = lookup_device("a100").efficiency
    assert row == 0.60
    default, explicit, other = compute([]), compute(["--efficiency", str(row)]), compute(["--efficiency", "0.45"])
    assert default == explicit
    assert all(default[label] == pytest.approx(other[label] * 0.45 / row, rel=1e-9) for label in default)
