"""The step-time model's recompute and overlap terms (issue 36): activation checkpointing costs what the trace saw
it rerun (the selective op policy less than full checkpointing, which had the same step time), and the
data-parallel communication a plugin issues during compute hides under it on a GPU (per-block FSDP's prefetched
gathers and reduce-scatters, DDP's and ZeRO's gradient buckets), never beyond the compute and never on the CPU."""

from __future__ import annotations

import pytest

from cx_plan import load_model_shape
from cx_plan._candidate import Candidate
from cx_plan._devices import lookup_device
from cx_plan.step_time._step_time import StepTime, flops_per_token, predict_step_time
from cx_plan.trace._model_spec import ModelShape
from cx_plan.trace._op_counts import op_counter
from cx_plan.trace._trace_cache import TraceCache

_SEQ = 64


@pytest.fixture(scope="module")
def llama() -> ModelShape:
    return load_model_shape("llama", hidden_size=64, num_layers=2, seq_len=_SEQ)


def _ddp(mode: str = "full", ratio: float = 1.0) -> Candidate:
    return Candidate("torch_ddp", precision="bf16", checkpoint_ratio=ratio, checkpoint_mode=mode)


def test_the_trace_counts_forward_and_recomputed_flops(llama: ModelShape) -> None:
    """The traced forward's matmul + attention FLOPs are the model's (`flops_per_token`: the same 6N + attention
    arithmetic, within 1 %); nothing is recomputed without checkpointing; full checkpointing reruns the layers'
    forward (up to their last matmul, which nothing saved needs: non-reentrant checkpointing stops early), and the
    op policy reruns less."""
    count = op_counter(llama, _SEQ, traces=TraceCache(llama, _SEQ))
    plain, full, selective = count(_ddp(ratio=0.0)), count(_ddp()), count(_ddp("selective-op"))
    assert plain is not None
    assert full is not None
    assert selective is not None
    per_token, in_layers = flops_per_token(llama, _SEQ)
    assert plain.forward_flops == pytest.approx(per_token * _SEQ / 3, rel=0.01)
    assert plain.recompute_flops == 0
    assert full.forward_flops == selective.forward_flops == plain.forward_flops
    assert full.recompute_fraction is not None
    assert selective.recompute_fraction is not None
    assert 0 < selective.recompute_fraction < full.recompute_fraction <= in_layers / per_token


@pytest.mark.parametrize("traced", [True, False])
def test_selective_op_checkpointing_costs_less_than_full(llama: ModelShape, traced: bool) -> None:
    """On an H100 the op policy's recompute (and so its compute) is shorter than full checkpointing's, with the
    trace's counts and with the fallback rule (half the layers' matmuls, no attention) alike; with no checkpointing
    none. (The whole step of so tiny a model is its kernel launches, which the op policy also cuts.)"""
    device = lookup_device("h100")
    count = op_counter(llama, _SEQ, exact=False, traces=TraceCache(llama, _SEQ))

    def step(candidate: Candidate) -> StepTime:
        return predict_step_time(candidate, llama, _SEQ, device, ops=count(candidate) if traced else None)

    none, full, selective = step(_ddp(ratio=0.0)), step(_ddp()), step(_ddp("selective-op"))
    assert none.recompute_s == 0
    assert 0 < selective.recompute_s < full.recompute_s
    assert none.compute_s < selective.compute_s < full.compute_s
    assert full.compute_s - full.recompute_s == pytest.approx(selective.compute_s - selective.recompute_s)


def _unhidden(step: StepTime) -> float:
    """The step as it was before the overlap rule: every term added."""
    return step.compute_s + sum(step.communication_s.values()) + step.optimizer_s


def test_per_block_fsdp_hides_its_communication_under_compute(llama: ModelShape) -> None:
    """Per-block FSDP on 8 H100s: its gathers and reduce-scatters overlap the micro-batches' compute, so the step is
    shorter than compute + communication, by at most the compute and leaving one unit's share exposed; under one
    root unit nothing overlaps, and on the (host-bound) CPU every collective still adds."""
    h100 = lookup_device("h100")
    block = Candidate("torch_fsdp", dp=8, micro_batch_size=2, num_microbatches=2, fsdp_wrap="block", precision="bf16")
    step = predict_step_time(block, llama, _SEQ, h100)
    communication = sum(step.communication_s.values())
    units = llama.num_layers + 1
    assert step.hidden_s > 0
    assert step.step_s == pytest.approx(_unhidden(step) - step.hidden_s, rel=1e-12)
    assert step.step_s < step.compute_s + communication + step.optimizer_s
    assert step.hidden_s <= min(step.compute_s, communication * (1 - 1 / units)) * (1 + 1e-12)
    assert step.step_s >= step.compute_s + step.optimizer_s + communication / units
    root = predict_step_time(Candidate(**{**block.__dict__, "fsdp_wrap": "model"}), llama, _SEQ, h100)
    assert root.hidden_s == 0
    assert root.step_s == pytest.approx(_unhidden(root), rel=1e-12)
    cpu = predict_step_time(block, llama, _SEQ, lookup_device("cpu"))
    assert cpu.hidden_s == 0


def test_gradient_buckets_hide_under_the_last_backward_but_not_the_last_bucket(llama: ModelShape) -> None:
    """DDP and LowLevelZero reduce their gradient buckets during the last micro-batch's backward, all but the last;
    a model of one bucket (this one: far below 25 MB) hides nothing, a larger model hides at most that backward, and
    LowLevelZero's weight all-gather after the step never hides."""
    h100 = lookup_device("h100")
    small = predict_step_time(Candidate("torch_ddp", dp=8, precision="bf16"), llama, _SEQ, h100)
    assert small.hidden_s == 0
    big = load_model_shape("llama", hidden_size=1024, num_layers=4, seq_len=_SEQ)
    for candidate in (
        Candidate("torch_ddp", dp=8, num_microbatches=2, precision="bf16"),
        Candidate("low_level_zero", dp=8, zero_stage=2, num_microbatches=2, precision="bf16"),
    ):
        step = predict_step_time(candidate, big, _SEQ, h100)
        gradients = sum(t for name, t in step.communication_s.items() if "gradient" in name)
        backward = (step.compute_s / candidate.num_microbatches) * 2 / 3  # no recompute here
        assert 0 < step.hidden_s < gradients
        assert step.hidden_s <= backward * (1 + 1e-9)
        assert step.step_s == pytest.approx(_unhidden(step) - step.hidden_s, rel=1e-12)
