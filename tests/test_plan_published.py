"""cx-plan against published memory figures: torchtitan's Llama 3.1 8B FSDP runs on H100, recomputed from
benchmarks/plan/llama3_1_8b_config.json with the configuration torchtitan ran (FSDP2 with one `fully_shard` per
transformer block, bf16 parameters with fp32 reduction, selective op activation checkpointing, AdamW, no
torch.compile, no Float8), each prediction within 15 % of the published figure (the issue's bar).

Source: torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan 9dec370, torch 1963fc8, 2024-12-26),
https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md; the training config,
torchtitan's `train_configs/llama3_8b.toml` of that time: seq_len 8192, activation_checkpoint mode 'selective',
selective_ac_option 'op' (the tables override the local batch to 2). The published figure is the allocator's
reserved peak (`max_reserved`), the prediction allocated tensor bytes, which reserved memory never undercuts: the
gap is reported beside the rows in benchmarks/plan/RESULTS.md, not folded into the prediction.

A second source gives a boundary, not a figure: torchtitan's `docs/performance.md` (2024, Llama 2 70B on 64 A100
80 GB, FSDP2, seq 4096, bf16 / fp32 reduce): local batch 1 with selective op checkpointing and local batch 2 with
full checkpointing ran; local batch 2 with selective op ran out of memory (its footnote 1). cx-plan must say the
same with `fits` (90 % of 80 GB usable), from benchmarks/plan/llama2_70b_config.json (Meta's Llama-2-70b-hf config).

Model states only (no activations): DeepSpeed's t5-3b table on 1 node x 8 GPUs (docs/code-docs/source/memory.rst,
`estimate_zero2/3_model_states_mem_needs_all_live`), recomputed here from DeepSpeed's formulas and set beside what
cx-plan predicts for cx's equivalent layouts; benchmarks/plan/RESULTS.md has the table and why the rows differ.
And a calibration, not a prediction: the `--routing-skew` at which cx-plan's compute loses what Megatron's published
Qwen3-235B runs lose to dropless routing against forced balance. Tokens/s per GPU: each device row's achievable
fraction of peak fitted to one run (h100_96gb: Table 1's eager run; a100: docs/performance.md's Llama 3 8B),
torch.compile's factor and fp8's gain over the achieved bf16 rate to Table 1's ratios; Table 3 (8B on 128 H100: the
fitted model and layout again) and the other A100 runs within the issue's 20 % and within 3 points of their error
when the fits were made (a regression bar; RESULTS.md says how independent each row is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cx_plan import ActivationTrace, Candidate, ParameterCounts, load_model_shape, predict_memory
from cx_plan._devices import lookup_device
from cx_plan.memory._fits import fits
from cx_plan.memory._gemini_chunks import gathered_in
from cx_plan.memory._memory import predict_memory_from_traces
from cx_plan.step_time._step_time import flops_per_token, worst_rank_expert_flops

CONFIG = Path(__file__).resolve().parents[1] / "benchmarks" / "plan" / "llama3_1_8b_config.json"
LLAMA2_70B = CONFIG.with_name("llama2_70b_config.json")
GIB = 2**30
_TOLERANCE = 0.15
# (GPUs, published GiB per GPU, where): the plain FSDP rows (no compile, no Float8) of Tables 1 and 3
PUBLISHED = [
    (8, 82.4, "torchtitan llama3_h100_202412 Table 1, FSDP, 8 x H100, local batch 2"),
    (128, 67.0, "torchtitan llama3_h100_202412 Table 3, FSDP, 128 x H100, local batch 2"),
]


@pytest.mark.parametrize(("gpus", "published", "source"), PUBLISHED, ids=["table1-8gpu", "table3-128gpu"])
def test_torchtitan_llama3_8b_fsdp_within_fifteen_percent(gpus: int, published: float, source: str) -> None:
    shape = load_model_shape(str(CONFIG))
    torchtitan = Candidate(
        "torch_fsdp", dp=gpus, micro_batch_size=2, precision="bf16", checkpoint_ratio=1.0,
        checkpoint_mode="selective-op", fsdp_wrap="block",
    )  # fmt: skip
    predicted = predict_memory(shape, torchtitan, seq_len=8192).peak / GIB
    assert abs(predicted - published) <= _TOLERANCE * published, f"{source}: {predicted:.1f} GiB vs {published}"


@pytest.mark.parametrize(
    ("local_batch", "mode", "ran"),
    [(1, "selective-op", True), (2, "selective-op", False), (2, "full", True)],
    ids=["mb1-op-ran", "mb2-op-oom", "mb2-full-ran"],
)
def test_torchtitan_llama2_70b_fsdp_boundary_on_a100(local_batch: int, mode: str, ran: bool) -> None:
    shape = load_model_shape(str(LLAMA2_70B))
    torchtitan = Candidate(
        "torch_fsdp", dp=64, micro_batch_size=local_batch, precision="bf16", checkpoint_ratio=1.0,
        checkpoint_mode=mode, fsdp_wrap="block",
    )  # fmt: skip
    verdict = fits(predict_memory(shape, torchtitan, seq_len=4096), lookup_device("a100").memory_bytes)
    assert verdict.fits == ran, f"local batch {local_batch}, {mode}: {verdict.peak_bytes / 1e9:.1f} GB"


# t5-3b (T5Model: shared embedding, 24 encoder and 24 decoder blocks; the first block of each stack holds the 32 x 32
# relative attention bias): 2,851,598,336 parameters, the largest module's own the shared embedding (32128 x 1024)
T5_3B = 2_851_598_336
T5_3B_LARGEST = 32_128 * 1_024
T5_3B_BLOCKS = (50_334_720,) + (50_333_696,) * 23 + (67_112_960,) + (67_111_936,) * 23
GPUS = 8
BUCKET_BYTES = 12 * 2**20 * 2  # LowLevelZero's reduce bucket, 12 M elements of bf16


def _deepspeed_zero2(params: int, offload: bool, docs_formula: bool) -> int:
    """DeepSpeed's ZeRO-2 GPU model states (memory.rst, "ZeRO-2"): 2 x params with the optimizer offloaded; without,
    4 x params + 16 x params / gpus in the docs (the table's figures) and 2 x params + 18 x params / gpus since
    DeepSpeed PR #5099 (2024-06-04: 16-bit parameters and gradients at 2 bytes, not 4)."""
    if offload:
        return 2 * params
    return 4 * params + 16 * params // GPUS if docs_formula else 2 * params + 18 * params // GPUS


def _deepspeed_zero3(params: int, largest: int, offload_optimizer: bool, offload_param: bool) -> int:
    """DeepSpeed's ZeRO-3 GPU model states (memory.rst, "ZeRO-3"): the largest layer's 16-bit parameters and
    gradients gathered (4 x largest) plus, per GPU, 18 x params / gpus (none offloaded), 2 x params / gpus (the
    optimizer offloaded) or nothing (both)."""
    per_gpu = 0 if offload_param else (2 if offload_optimizer else 18) * params // GPUS
    return 4 * largest + per_gpu


@pytest.mark.parametrize(
    ("published", "estimate"),
    [
        (15.93, _deepspeed_zero2(2851 * 10**6, offload=False, docs_formula=True)),
        (5.31, _deepspeed_zero2(2851 * 10**6, offload=True, docs_formula=True)),
        (6.09, _deepspeed_zero3(2851 * 10**6, 32 * 10**6, offload_optimizer=False, offload_param=False)),
        (0.78, _deepspeed_zero3(2851 * 10**6, 32 * 10**6, offload_optimizer=True, offload_param=False)),
        (0.12, _deepspeed_zero3(2851 * 10**6, 32 * 10**6, offload_optimizer=True, offload_param=True)),
        (6.10, _deepspeed_zero3(T5_3B, T5_3B_LARGEST, offload_optimizer=False, offload_param=False)),
        (0.79, _deepspeed_zero3(T5_3B, T5_3B_LARGEST, offload_optimizer=True, offload_param=False)),
    ],
    ids=["z2-cold", "z2-offload-cold", "z3-cold", "z3-optim-cold", "z3-both-cold", "z3-live", "z3-optim-live"],
)
def test_deepspeed_formulas_give_its_published_t5_3b_table(published: float, estimate: int) -> None:
    # the "cold" rows pass total_params=2851e6, largest_layer_params=32e6; the "live" ones count the model
    assert f"{estimate / GIB:.2f}" == f"{published:.2f}"


def test_deepspeed_current_zero2_formula_gives_less_than_its_table() -> None:
    # the table predates PR #5099: today's code prints 11.28 GiB (cold) / 11.29 (live) for the 15.93 row
    assert f"{_deepspeed_zero2(2851 * 10**6, offload=False, docs_formula=False) / GIB:.2f}" == "11.28"
    assert f"{_deepspeed_zero2(T5_3B, offload=False, docs_formula=False) / GIB:.2f}" == "11.29"


def _t5_3b() -> Any:
    """t5-3b's config (d_model 1024, d_ff 16384, 32 heads of 128, 24 + 24 layers, vocabulary 32128), built on meta."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=32_128, d_model=1_024, d_kv=128, d_ff=16_384, num_layers=24, num_heads=32,
        feed_forward_proj="relu", tie_word_embeddings=True,
    )  # fmt: skip
    with torch.device("meta"):
        return transformers.T5Model(config)


def test_t5_3b_parameter_counts() -> None:
    model = _t5_3b()
    assert sum(dict((id(p), p.numel()) for p in model.parameters()).values()) == T5_3B
    blocks = [*model.encoder.block, *model.decoder.block]
    assert tuple(sum(p.numel() for p in block.parameters()) for block in blocks) == T5_3B_BLOCKS
    assert max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()) == T5_3B_LARGEST


def _cx_model_states(candidate: Candidate) -> float:
    """cx-plan's peak for t5-3b's parameters with no activations (a trace of none): the model states at their own
    peak, the end of the backward. cx-plan traces decoder-only models, so the trace is written, not made; Gemini's
    chunks are laid out on t5-3b built on meta (`gathered_in`: the shared embedding set apart, a decoder block's)."""
    states = ActivationTrace(
        stage=0, parameter_bytes=2 * T5_3B, activation_bytes=0, gradient_bytes=0, gradient_total_bytes=2 * T5_3B,
        peak_bytes=2 * T5_3B, saved_bytes=0, parameter_count=T5_3B,
    )  # fmt: skip
    counts = ParameterCounts(
        total=T5_3B, outer=T5_3B - sum(T5_3B_BLOCKS), embeddings=T5_3B_LARGEST, dense_per_layer=T5_3B_BLOCKS,
        experts_per_layer=(0,) * len(T5_3B_BLOCKS), per_expert=0, tied=True,
    )  # fmt: skip
    gathered = gathered_in(_t5_3b(), candidate.dp) if candidate.plugin == "gemini" else None
    return predict_memory_from_traces(candidate, [states], counts, gemini_gathered=gathered).peak / GIB


# (DeepSpeed's row, its published GiB, cx's layout, cx-plan's GiB as benchmarks/plan/RESULTS.md prints it)
MODEL_STATES = [
    ("zero2", 15.93, Candidate("low_level_zero", dp=GPUS, zero_stage=2), 10.69),
    ("zero2 as the docs count (zero1)", 15.93, Candidate("low_level_zero", dp=GPUS, zero_stage=1), 15.96),
    ("zero2 offload_optimizer", 5.31, Candidate("low_level_zero", dp=GPUS, zero_stage=2, cpu_offload=True), 5.38),
    ("zero3", 6.10, Candidate("torch_fsdp", dp=GPUS, fsdp_wrap="block"), 5.48),
    ("zero3 (gemini)", 6.10, Candidate("gemini", dp=GPUS), 6.16),
    ("zero3 offload_optimizer", 0.79, Candidate("gemini", dp=GPUS, offload_optim_frac=1.0), 3.51),
    ("zero3 offload_param + optimizer", 0.12,
     Candidate("gemini", dp=GPUS, offload_optim_frac=1.0, offload_param_frac=1.0), 2.18),
]  # fmt: skip


@pytest.mark.parametrize(("row", "published", "candidate", "table"), MODEL_STATES, ids=[r[0] for r in MODEL_STATES])
def test_t5_3b_model_states_rows(row: str, published: float, candidate: Candidate, table: float) -> None:
    assert round(_cx_model_states(candidate), 2) == table, row


def test_t5_3b_zero2_is_deepspeeds_current_formula_less_the_16_bit_gradient_shard() -> None:
    # DeepSpeed today: 2P + (2 + 4 + 4 + 8) P / 8. cx's LowLevelZero reduces each 16-bit bucket straight into the
    # fp32 gradient shard, so it has no 16-bit shard (2P / 8) but holds two buckets and the one being reduced
    cx = _cx_model_states(Candidate("low_level_zero", dp=GPUS, zero_stage=2)) * GIB
    current = _deepspeed_zero2(T5_3B, offload=False, docs_formula=False)
    assert cx == current - 2 * T5_3B // GPUS + 3 * BUCKET_BYTES
    # with the optimizer offloaded both keep the 16-bit parameters only (cx: and the buckets)
    offload = _cx_model_states(Candidate("low_level_zero", dp=GPUS, zero_stage=2, cpu_offload=True)) * GIB
    assert offload == _deepspeed_zero2(T5_3B, offload=True, docs_formula=True) + 3 * BUCKET_BYTES


QWEN3_235B = CONFIG.with_name("qwen3_235b_a22b_config.json")


@pytest.mark.parametrize(
    ("seq_len", "ratio", "skew"), [(16_384, 237 / 295, 1.81), (131_072, 357 / 389, 2.41)], ids=["16k", "128k"]
)
def test_megatron_qwen3_235b_routing_skew_calibration(seq_len: int, ratio: float, skew: float) -> None:
    # a calibration, not a prediction (benchmarks/plan/RESULTS.md): the S at which cx-plan's compute, with the hot
    # ep rank running S x its share of the routed FLOPs, slows by the published dropless / forced-balance ratio
    # (yanring/Megatron-MoE-ModelZoo best_practice/Qwen3/readme.md: 237 / 295 TFLOPS at 16K, 357 / 389 at 128K)
    shape = load_model_shape(str(QWEN3_235B))
    assert shape.parameters.total == 235_093_634_560
    per_token, _ = flops_per_token(shape, seq_len)
    hot = Candidate("moe_hybrid", dp=8, ep=8, routing_skew=2.0)  # S - 1 = 1: the extra FLOPs of one more share
    extra = worst_rank_expert_flops(hot, shape)
    assert extra == 6 * shape.parameters.experts * shape.top_k / shape.num_experts
    fitted = 1 + (1 / ratio - 1) * per_token / extra
    assert round(fitted, 2) == skew
    # and back: that S slows cx-plan's compute by the published ratio
    slowed = per_token + worst_rank_expert_flops(Candidate("moe_hybrid", dp=8, ep=8, routing_skew=fitted), shape)
    assert per_token / slowed == pytest.approx(ratio, rel=1e-9)


def test_other_estimators_on_the_llama_runs() -> None:
    # docs/plan.md, "cx-plan beside other estimators": DeepSpeed's ZeRO-3 formula and accelerate's "Training using
    # Adam" (accelerate's own rule where it is installed) for torchtitan's Llama 3.1 8B and cx's tiny Llama
    estimate = pytest.importorskip("accelerate.commands.estimate")
    sizes = pytest.importorskip("accelerate.utils").calculate_maximum_sizes
    import torch

    from cx_plan import build_model

    eight_b = load_model_shape(str(CONFIG))
    embedding = eight_b.vocab_size * eight_b.hidden_size  # the largest module's own parameters
    zero3 = 4 * embedding + 18 * eight_b.parameters.total // 8
    assert f"{zero3 / GIB:.2f}" == "18.78"
    tiny = load_model_shape("llama", hidden_size=64, num_layers=2, seq_len=32)
    assert tiny.parameters.total == 80_448
    figures = {}
    for name, shape, dtype, scale in [
        ("8b-fp32", eight_b, "float32", GIB), ("8b-fp16", eight_b, "float16", GIB), ("tiny", tiny, "float32", 1e6)
    ]:  # fmt: skip
        with torch.device("meta"):
            total, _ = sizes(build_model(shape))
        figures[name] = f"{max(estimate.estimate_training_usage(total, dtype).values()) / scale:.2f}"
    assert figures == {"8b-fp32": "119.66", "8b-fp16": "59.83", "tiny": "1.29"}


# Tokens/s per GPU (benchmarks/plan/published_tps.py writes the whole table into RESULTS.md): torchtitan's Table 1
# (8 H100) and Table 3 (128 H100), eager / + torch.compile / + compile + Float8, the FSDP runs above, on cx-plan's
# h100_96gb row (the benchmark's 500 W, 96 GB HBM2e H100)
TPS_ROWS = {8: (5762, 6667, 8532), 128: (5605, 6514, 8380)}
_TPS_TARGET = 0.20  # the bar for tokens/s per GPU


def _fsdp_tps(config: Path, seq: int, device: str, gpus: int, local_batch: int, mode: str, kernels: Any) -> float:
    """cx-plan's tokens/s per GPU for torchtitan's FSDP2 run (per block, bf16 with fp32 reduction)."""
    from cx_plan._devices import lookup_device
    from cx_plan.step_time._step_time import predict_step_time
    from cx_plan.trace._op_counts import op_counter

    shape = load_model_shape(str(config))
    ratio, how = {"op": (1.0, "selective-op"), "full": (1.0, "full"), "none": (0.0, "full")}[mode]
    torchtitan = Candidate(
        "torch_fsdp", dp=gpus, micro_batch_size=local_batch, precision="bf16", checkpoint_ratio=ratio,
        checkpoint_mode=how, fsdp_wrap="block",
    )  # fmt: skip
    ops = op_counter(shape, seq, exact=False)(torchtitan)
    step = predict_step_time(torchtitan, shape, seq, lookup_device(device), ops=ops, kernels=kernels)
    return step.tokens_per_s / gpus


def _tps_per_gpu(gpus: int, device: str = "h100_96gb") -> tuple[float, float, float]:
    from cx_plan.step_time._kernels import COMPILE_SPEEDUP, FP8_GAIN, Kernels

    kernels = (Kernels(), Kernels(COMPILE_SPEEDUP), Kernels(COMPILE_SPEEDUP, FP8_GAIN))
    eager, compiled, fp8 = (_fsdp_tps(CONFIG, 8192, device, gpus, 2, "op", k) for k in kernels)
    return eager, compiled, fp8


_REGRESSION = 0.03  # a held-out row may move this far from its error when the fits were made (RESULTS.md's table)
# each row's error (predicted / published - 1) when the fits were made: Table 1 (8 GPUs) and Table 3 (128 GPUs)
TPS_ERRORS = {8: (-0.001, 0.001, 0.002), 128: (0.028, 0.025, 0.022)}


def test_torchtitan_compile_and_fp8_factors_fit_table1_and_carry_to_table3() -> None:
    # fitted on Table 1's ratios at h100_96gb's efficiency 0.40 (published_tps.py solves 1.158 and a gain of 1.437;
    # the code holds 1.16 and 1.44, which moves the fp8 ratio by 0.3 %, hence 1 %), held out on Table 3's: the same
    # factors give 128 GPUs' ratios within 2 %
    for gpus, tolerance in ((8, 0.01), (128, 0.02)):
        eager, compiled, fp8 = _tps_per_gpu(gpus)
        published = TPS_ROWS[gpus]
        assert compiled / eager == pytest.approx(published[1] / published[0], rel=tolerance), gpus
        assert fp8 / compiled == pytest.approx(published[2] / published[1], rel=tolerance), gpus
        # absolute: Table 1's eager run is h100_96gb's efficiency fit (0.4003 solved, 0.40 held: within 1 %); the
        # others within the 20 % and within 3 points of their error at the fit (Table 3: +2.2 to +2.8 %)
        for predicted, figure, error in zip((eager, compiled, fp8), published, TPS_ERRORS[gpus], strict=True):
            off = predicted / figure - 1
            assert abs(off) <= (0.01 if (gpus, figure) == (8, 5762) else _TPS_TARGET), (gpus, figure, off)
            assert abs(off - error) <= _REGRESSION, (gpus, figure, off, error)


def test_fp8_gain_carries_to_the_h100_row() -> None:
    # the fp8 gain is over the row's own achieved bf16 rate, so on the `h100` (SXM, 45 %) row Table 1's layout keeps
    # the published ratio of fp8 to compiled (1.280) as on h100_96gb, within 2 % (the linear share of the compute
    # barely moves with the row); a fitted fraction of the fp8 peak gave 1.192 there
    _, compiled, fp8 = _tps_per_gpu(8, "h100")
    assert fp8 / compiled == pytest.approx(TPS_ROWS[8][2] / TPS_ROWS[8][1], rel=0.02)


# torchtitan docs/performance.md (2024): 64 A100 80 GB, FSDP2, bf16 / fp32 reduction, no compile or Float8; WPS per
# GPU. Llama 3 8B (mb 1, selective op) is a100's efficiency fit (0.6039 solved, 0.60 held); the rest are held out, each
# within the 20 % and within 3 points of its error at the fit (the last column).
A100_ROWS = [
    (CONFIG, 8192, 1, "op", 2973, -0.006),
    (CONFIG.with_name("llama3_70b_config.json"), 8192, 1, "full", 331, -0.063),
    (CONFIG.with_name("llama2_13b_config.json"), 4096, 2, "none", 2162, -0.012),
    (CONFIG.with_name("llama2_13b_config.json"), 4096, 2, "op", 1904, 0.009),
    (LLAMA2_70B, 4096, 1, "op", 355, 0.062),
    (LLAMA2_70B, 4096, 2, "full", 353, -0.046),
]


@pytest.mark.parametrize(
    ("config", "seq", "local_batch", "mode", "published", "error"),
    A100_ROWS,
    ids=["3-8b-mb1-op-fit", "3-70b-mb1-full", "2-13b-mb2-none", "2-13b-mb2-op", "2-70b-mb1-op", "2-70b-mb2-full"],
)
def test_torchtitan_a100_tokens_per_second(
    config: Path, seq: int, local_batch: int, mode: str, published: int, error: float
) -> None:
    # Llama 2 70B at mb 1 was -47 % while ring collectives across nodes ran at one NIC's 25 GB/s (its FSDP traffic,
    # 21.9 s, did not fit under 14.4 s of compute); at the node's 8 NICs together it hides (RESULTS.md: that change
    # was made after seeing this row, so it is not independent evidence)
    from cx_plan.step_time._kernels import Kernels

    predicted = _fsdp_tps(config, seq, "a100", 64, local_batch, mode, Kernels())
    off = predicted / published - 1
    tolerance = 0.01 if config == CONFIG else _TPS_TARGET  # the 8B row is a100's efficiency fit
    assert abs(off) <= tolerance, f"{config.name} mb{local_batch} {mode}: {predicted:.0f}"
    assert abs(off - error) <= _REGRESSION, f"{config.name} mb{local_batch} {mode}: {off:+.3f} against {error:+.3f}"
