"""cx-plan's host terms (issue 26): the trace's op and tensor counts, what the counts cost on the CPU (added, and
slower with more ranks than cores) and on a GPU (hidden under the kernels unless longer), and the ranking agreement
that allows ties within the measured noise."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cx_plan import load_model_shape
from cx_plan._candidate import Candidate
from cx_plan._devices import lookup_device
from cx_plan.measure._agreement import Agreement, Timing, agreement, timing
from cx_plan.measure._measure import measure_candidate
from cx_plan.step_time._host_time import OpCounts, host_time, plugin_ops_per_tensor, plugin_tensor_s
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace import _activations, _op_counts
from cx_plan.trace import _trace_cache as trace_cache_module
from cx_plan.trace._activations import trace_stage
from cx_plan.trace._model_spec import ModelShape, shape_from_config
from cx_plan.trace._trace_cache import TraceCache
from cx_plugins.models import GPTConfig

_SEQ = 16
_TINY = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=17, hidden_size=32, num_layers=2, num_heads=4))
_OPS = OpCounts(forward=100, backward=200, parameter_tensors=28)


def test_the_trace_counts_ops_and_tensors_and_recompute_repeats_the_forward() -> None:
    llama = load_model_shape("llama", hidden_size=32, num_layers=2, seq_len=_SEQ)
    plain = trace_stage(llama, Candidate("torch_ddp", precision="fp32"), _SEQ)
    recomputed = trace_stage(llama, Candidate("torch_ddp", precision="fp32", checkpoint_ratio=1.0), _SEQ)
    # 2 layers x 9 (q, k, v, o, gate, up, down, two norms) + embedding, final norm, LM head
    assert plain.parameter_tensors == 21
    assert 0 < plain.forward_ops < plain.backward_ops
    # checkpointing re-runs the layers' forwards inside the backward (measured: 324 -> 606 backward ops, the forward
    # 236 -> 242 with the checkpoint wrappers' own)
    assert recomputed.backward_ops > plain.backward_ops
    # selective op checkpointing recomputes only what its policy does not save: counted under its own policy
    count = _op_counts.op_counter(llama, _SEQ)
    full = count(Candidate("torch_ddp", precision="fp32", checkpoint_ratio=1.0))
    selective = count(Candidate("torch_ddp", precision="fp32", checkpoint_ratio=1.0, checkpoint_mode="selective-op"))
    assert full is not None
    assert selective is not None
    assert plain.backward_ops < selective.backward < full.backward


class _AtenCount(TorchDispatchMode):
    """A mode of its own counting the aten ops dispatched under it (how the trace counted before the peak tracker
    did)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.namespace == "aten"
        return func(*args, **(kwargs or {}))


class _DevicePassedDown(_activations._PeakTracker):
    """The peak tracker sending FakeTensor device queries down through the modes below (as before)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.prim.device.default:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_the_peak_tracker_counts_what_a_mode_of_its_own_counts(monkeypatch: pytest.MonkeyPatch, ratio: float) -> None:
    """The op count fed by the peak tracker equals that of a counting mode above it, and the trace with every device
    query sent down through the modes (FakeTensorMode's own answer) has the same figures: answering it at the top
    changes nothing."""
    llama = load_model_shape("llama", hidden_size=32, num_layers=2, seq_len=_SEQ)
    candidate = Candidate("hybrid", pp=2, num_microbatches=2, precision="fp32", checkpoint_ratio=ratio)
    counters: list[_AtenCount] = []
    real_run = _activations._run

    def counted_run(*args: Any) -> None:
        with _AtenCount() as counter:
            counters.append(counter)
            real_run(*args)

    monkeypatch.setattr(_activations, "_run", counted_run)
    for stage in (0, 1):
        counters.clear()
        answered = _activations._trace_exact(llama, candidate, _SEQ, stage)
        assert answered.forward_ops + answered.backward_ops == counters[0].count > 0
        with monkeypatch.context() as patch:
            patch.setattr(_activations, "_PeakTracker", _DevicePassedDown)
            assert _activations._trace_exact(llama, candidate, _SEQ, stage) == answered


def test_data_parallel_plugins_share_one_count(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Candidate] = []

    def traced(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int = 0) -> object:
        calls.append(candidate)
        return trace_stage(shape, candidate, seq_len, stage)

    monkeypatch.setattr(trace_cache_module, "trace_stage", traced)
    count = _op_counts.op_counter(_TINY, _SEQ, traces=TraceCache(_TINY, _SEQ))
    same = [Candidate("torch_ddp", dp=2, micro_batch_size=2), Candidate("gemini", dp=2), Candidate("low_level_zero")]
    assert len({count(c) for c in same}) == 1
    assert len(calls) == 1
    assert count(Candidate("hybrid", dp=2)) is not None
    assert len(calls) == 2


def test_cpu_host_terms_add_and_scale_with_ops_tensors_and_oversubscription() -> None:
    cpu = lookup_device("cpu")  # 2 cores
    one = Candidate("hybrid", dp=2, micro_batch_size=2, precision="fp32")
    base = predict_step_time(one, _TINY, _SEQ, cpu, ops=_OPS)
    more = predict_step_time(one, _TINY, _SEQ, cpu, ops=dataclasses.replace(_OPS, forward=400))
    assert more.step_s - base.step_s == pytest.approx(300 * cpu.op_s, rel=1e-9)  # added, not overlapped
    tensors = predict_step_time(one, _TINY, _SEQ, cpu, ops=dataclasses.replace(_OPS, parameter_tensors=56))
    per_tensor = cpu.optimizer_tensor_s + plugin_tensor_s(one, cpu)
    assert tensors.step_s - base.step_s == pytest.approx(28 * per_tensor, rel=1e-9)
    assert base.step_s == pytest.approx(
        base.compute_s + base.dispatch_s + base.plugin_s + base.optimizer_s + base.optimizer_overhead_s
        + sum(base.communication_s.values()), rel=1e-9,
    )  # fmt: skip
    # 4 ranks on 2 cores: every host term, the compute and each collective hop take twice as long
    four = predict_step_time(dataclasses.replace(one, dp=4), _TINY, _SEQ, cpu, ops=_OPS)
    assert (base.oversubscription, four.oversubscription) == (1.0, 2.0)
    assert four.dispatch_s == pytest.approx(2 * base.dispatch_s, rel=1e-9)
    assert four.optimizer_overhead_s == pytest.approx(2 * base.optimizer_overhead_s, rel=1e-9)
    assert four.compute_s == pytest.approx(2 * base.compute_s, rel=1e-9)  # the same tokens a rank, at half the rate
    assert four.step_s > base.step_s


def test_plugin_work_orders_the_data_parallel_plugins() -> None:
    """Measured per parameter tensor on the CPU: hybrid ZeRO 0 adds nothing on one rank, DDP its hooks, ZeRO its
    bucket and shard copies (more once sharded), Gemini its chunk copies, FSDP2 its DTensor dispatch (per-block FSDP
    its per-unit hooks on top); a GPU row without measurements falls back to the counted ops at its per-op cost."""
    cpu = lookup_device("cpu")
    times = {
        name: predict_step_time(c, _TINY, _SEQ, cpu, ops=_OPS).step_s
        for name, c in {
            "hybrid0": Candidate("hybrid", precision="fp32"),
            "ddp": Candidate("torch_ddp", precision="fp32"),
            "zero1": Candidate("low_level_zero", zero_stage=1, precision="fp32"),
            "gemini": Candidate("gemini", precision="fp32"),
            "fsdp": Candidate("torch_fsdp", precision="fp32"),
            "fsdp per-block": Candidate("torch_fsdp", fsdp_wrap="block", precision="fp32"),
        }.items()
    }
    assert times["hybrid0"] < times["ddp"] < times["zero1"] < times["gemini"] < times["fsdp"] < times["fsdp per-block"]
    assert plugin_ops_per_tensor(Candidate("low_level_zero", dp=2)) > plugin_ops_per_tensor(Candidate("low_level_zero"))
    assert host_time(Candidate("hybrid"), None, cpu).forward_s == 0.0  # no counts: no host terms
    h100 = lookup_device("h100")
    assert plugin_tensor_s(Candidate("low_level_zero", dp=2), h100) == 21 * h100.op_s


def test_gpu_dispatch_hides_under_the_kernels_and_zero_rows_change_nothing() -> None:
    h100 = lookup_device("h100")
    big = shape_from_config(
        "gpt", GPTConfig(vocab_size=32000, max_positions=4097, hidden_size=4096, num_layers=32, num_heads=32)
    )
    layout = Candidate("torch_fsdp", dp=8, micro_batch_size=2, precision="bf16")
    ops = OpCounts(forward=3000, backward=6000, parameter_tensors=291)  # an 8B-class model's order of magnitude
    before = predict_step_time(layout, big, 4096, h100)  # the FLOP / bandwidth model alone
    assert predict_step_time(layout, big, 4096, h100, ops=ops).step_s == before.step_s  # 45 ms of launches, hidden
    zero = dataclasses.replace(h100, op_s=0.0)
    assert predict_step_time(layout, big, 4096, zero, ops=ops).step_s == before.step_s
    # a tiny model's kernels are shorter than their launches: then the launches are the time
    tiny = predict_step_time(Candidate("torch_ddp"), _TINY, _SEQ, h100, ops=_OPS)
    assert tiny.step_s > predict_step_time(Candidate("torch_ddp"), _TINY, _SEQ, h100).step_s
    assert tiny.step_s >= (_OPS.forward + _OPS.backward) * h100.op_s


def test_agreement_counts_ties_within_the_spread() -> None:
    assert timing([[3.0, 1.0, 2.0], [4.0, 5.0, 6.0]]) == Timing(median=3.5, spread=3.0)
    with pytest.raises(ValueError, match="at least one round"):
        timing([[]])
    order = ["a", "b", "c"]
    clear = {"a": Timing(10.0, 1.0), "b": Timing(20.0, 1.0), "c": Timing(30.0, 1.0)}
    assert agreement(order, clear) == Agreement(strict=True, within_noise=True)
    # b measured faster than a by 2, less than b's spread of 3: a tie either order matches, not a strict agreement
    tie = clear | {"b": Timing(8.0, 3.0)}
    result = agreement(order, tie)
    assert (result.strict, result.within_noise) == (False, True)
    # by 2 with spreads of 1: a real reversal
    reversed_pair = clear | {"b": Timing(8.0, 1.0)}
    assert not agreement(order, reversed_pair).within_noise
    # the first and last reversed beyond noise, though each neighbouring pair is a tie
    chain = {"a": Timing(14.0, 3.0), "b": Timing(12.0, 3.0), "c": Timing(10.0, 3.0)}
    assert not agreement(order, chain).within_noise
    with pytest.raises(ValueError, match="no measurement for c"):
        agreement(order, {"a": clear["a"], "b": clear["b"]})


def test_measure_runs_a_gpt_pipeline() -> None:
    """cx's GPT returns its loss as a tensor, which the pipeline's loss function took `.loss` of (the ranking run's
    gpt pp2 candidates failed with "'Tensor' object has no attribute 'loss'")."""
    candidate = Candidate("hybrid", pp=2, num_microbatches=2, precision="fp32")
    measured = measure_candidate(candidate, "gpt", hidden=32, layers=2, seq_len=_SEQ, steps=1)
    assert measured.error == ""
    assert len(measured.peaks) == 2


def test_gpu_planning_traces_the_whole_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the counts only matter for tiny models, so the planner shares one whole-model trace out over the
    pipeline stages instead of tracing every split (an 8B search took 7.5 minutes with a trace per split)."""
    calls: list[Candidate] = []

    def traced(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int = 0) -> object:
        calls.append(candidate)
        return trace_stage(shape, candidate, seq_len, stage)

    monkeypatch.setattr(trace_cache_module, "trace_stage", traced)
    count = _op_counts.op_counter(_TINY, _SEQ, exact=False, traces=TraceCache(_TINY, _SEQ))
    whole = count(Candidate("hybrid", tp=2, precision="fp32"))
    half = count(Candidate("hybrid", pp=2, num_microbatches=2, precision="fp32"))
    assert whole is not None
    assert half is not None
    assert len(calls) == 1
    assert (half.forward, half.parameter_tensors) == (round(whole.forward / 2), whole.parameter_tensors // 2)
