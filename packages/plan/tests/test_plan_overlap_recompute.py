"""The step-time model's recompute term (issue 36): activation checkpointing costs what the trace saw it rerun (the
selective op policy less than full checkpointing, which had the same step time)."""

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
