"""The search at scale: the bounds before a trace (model states, a shallower model, the frugal split, micro-batch
floors, the first stage) rule candidates out without changing a verdict, traces are shared
across the data-parallel plugins, an interleaved or ZB-V split of an HF model traces, and the search reports progress
and stops at its time limit with the best found so far."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cx_plan import _planner as planner
from cx_plan._candidate import Candidate
from cx_plan._devices import lookup_device
from cx_plan._enumerate import SearchSpace, enumerate_candidates
from cx_plan.memory._memory import predict_memory_from_traces
from cx_plan.memory._memory_model import floor_trace, memory_model
from cx_plan.memory._states_floor import states_floor, with_states_floor
from cx_plan.trace import _trace_cache as trace_cache_module
from cx_plan.trace._activations import ActivationTrace, trace_stage
from cx_plan.trace._model_spec import ModelShape, load_model_shape, shape_from_config
from cx_plan.trace._trace_cache import TraceCache, slope_key
from cx_plugins.models import GPTConfig

_SEQ = 32


def _gpt() -> ModelShape:
    return shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=_SEQ + 1, hidden_size=32, num_layers=2))


def _space(**fields: object) -> SearchSpace:
    return SearchSpace(global_batch=8, pp_styles=("1f1b",), precision="fp32", **fields)  # type: ignore[arg-type]


def test_the_floor_never_exceeds_the_traced_prediction() -> None:
    """For every candidate of micro-batch k > 1, the floor from the traces at 1 (and 2) predicts no more than its own
    trace does: the bound can only rule out what a trace would rule out."""
    shape = _gpt()
    cache = TraceCache(shape, _SEQ)
    checked = 0
    for candidate in enumerate_candidates(shape, 2, _SEQ, _space()):
        k, stages = candidate.micro_batch_size, sorted({0, candidate.pp - 1})
        if k == 1:
            continue
        own = [cache.get(candidate, s) for s in stages]
        ones = [cache.get(Candidate(**{**candidate.__dict__, "micro_batch_size": 1}), s) for s in stages]
        twos = [cache.get(Candidate(**{**candidate.__dict__, "micro_batch_size": 2}), s) for s in stages]
        made = [t for t in own + ones + twos if isinstance(t, ActivationTrace)]
        n = len(stages)
        if len(made) < 3 * n:  # a split cx refuses
            continue
        own_t, ones_t, twos_t = made[:n], made[n : 2 * n], made[2 * n :]
        true = predict_memory_from_traces(candidate, own_t, shape.parameters).peak
        for smaller in ([(o,) for o in ones_t], list(zip(ones_t, twos_t, strict=True))):
            floors = [floor_trace(candidate, *pair) for pair in smaller]
            assert predict_memory_from_traces(candidate, floors, shape.parameters).peak <= true, candidate
        checked += 1
    assert checked > 10


def test_pruned_and_unpruned_plans_have_the_same_rows() -> None:
    """With the device's memory between the candidates' peaks (a quarter of them fit: at the median only DDP's
    micro-batch 4 was ruled out, and its whole-model trace is one the sharding plugins need anyway), the plan with
    the floor has the same fitting rows (same candidates, peaks and step times, in the same order) and the same
    misses as tracing every candidate, from fewer traces."""
    shape = _gpt()
    full_cache = TraceCache(shape, _SEQ)
    probe = memory_model(shape, _SEQ, 10**12, cache=full_cache, bound=False)
    peaks = sorted(p for c in enumerate_candidates(shape, 2, _SEQ, _space()) if (p := probe(c).peak_bytes))
    device = lookup_device("cpu", memory_bytes=int(peaks[len(peaks) // 4] / 0.9))
    reports = []
    caches = []
    for bound in (False, True):
        cache = TraceCache(shape, _SEQ)
        model = memory_model(shape, _SEQ, device.memory_bytes, host_is_device=True, cache=cache, bound=bound)
        reports.append(planner.plan(shape, 2, _SEQ, device, model, space=_space()))
        caches.append(cache)
    full, pruned = reports
    fitting = [
        [(r.candidate, r.memory.peak_bytes, r.step.step_s) for r in rep.rows if r.memory.fits] for rep in reports
    ]
    assert fitting[0] == fitting[1]
    assert fitting[0]
    assert {r.candidate for r in full.rows if not r.memory.fits} == {
        r.candidate for r in pruned.rows if not r.memory.fits
    }
    assert any("at least: the bound" in r.memory.reason for r in pruned.rows)
    assert caches[1].made < caches[0].made


def test_data_parallel_plugins_share_one_whole_model_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP, FSDP, LowLevelZero and Gemini run the whole model unchanged: one trace per micro-batch and checkpointing
    choice serves them all, at any dp size."""
    shape = _gpt()
    made: list[Candidate] = []
    real = trace_stage

    def counting(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int, *rest: None) -> ActivationTrace:
        made.append(candidate)
        return real(shape, candidate, seq_len, stage)

    monkeypatch.setattr(trace_cache_module, "trace_stage", counting)
    model = memory_model(shape, _SEQ, 10**12, cache=TraceCache(shape, _SEQ))
    for candidate in (
        Candidate("torch_ddp", dp=2, precision="fp32"),
        Candidate("torch_fsdp", dp=4, fsdp_wrap="block", precision="fp32"),
        Candidate("low_level_zero", dp=2, zero_stage=1, precision="fp32"),
        Candidate("gemini", dp=8, precision="fp32"),
    ):
        assert model(candidate).fits
    assert len(made) == 1


@pytest.mark.parametrize("style", ["interleaved", "zbv"])
def test_interleaved_splits_of_an_hf_folder_trace(tmp_path: Path, style: str) -> None:
    """An HF Llama's interleaved and ZB-V stages trace (they failed: `is_first_stage` of an interleaved pipeline
    depends on the chunk) and hold a share of the parameters."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(str(tmp_path))
    candidate = Candidate("hybrid", pp=2, num_microbatches=2, pp_style=style, precision="fp32")
    verdict = memory_model(shape, _SEQ, 10**12, cache=TraceCache(shape, _SEQ))(candidate)
    assert verdict.fits, verdict.reason
    assert 0 < verdict.prediction.parameters < 4 * shape.parameters.total


def test_progress_and_time_limit() -> None:
    """The search calls `progress` per judged candidate, and past its time limit stops, saying so in the table."""
    shape = _gpt()
    device = lookup_device("cpu")
    seen: list[tuple[int, int, int]] = []
    model = memory_model(shape, _SEQ, device.memory_bytes, cache=TraceCache(shape, _SEQ))
    report = planner.plan(shape, 2, _SEQ, device, model, space=_space(), enough=3,
                          progress=lambda *args: seen.append(args))  # fmt: skip
    assert report.stopped is None
    assert seen
    assert seen[-1][2] == 3
    stopped = planner.plan(shape, 2, _SEQ, device, model, space=_space(), time_limit=0.0)
    assert stopped.stopped is not None
    assert not stopped.rows
    assert "stopped at the time limit" in stopped.table()


def test_the_bounds_before_a_trace_never_exceed_the_traced_prediction(tmp_path: Path) -> None:
    """On every candidate of a small search over a model deep enough to be extrapolated (5 layers per stage), the
    model-states floor, the shallower model's first stage, the same split's frugal first stage (micro-batch 1, full
    checkpointing) and that stage of the shallower model, and the candidate's own first stage each predict no more
    than its full traces: a bound can only rule out what a trace would rule out."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(str(tmp_path))
    cache = TraceCache(shape, _SEQ)
    space = SearchSpace(
        plugins=("torch_ddp", "hybrid"),
        global_batch=2,
        pp_styles=("1f1b", "zbv"),
        precision="fp32",
        checkpoint_ratios=(0.0, 0.5, 1.0),
    )
    checked = 0
    for candidate in enumerate_candidates(shape, 2, _SEQ, space):
        own = [cache.get(candidate, s) for s in sorted({0, candidate.pp - 1})]
        one = dataclasses.replace(candidate, micro_batch_size=1)
        frugal = dataclasses.replace(one, checkpoint_ratio=1.0, checkpoint_mode="full")
        shallow, first, split = cache.shallow(one, 0), cache.get(frugal, 0), cache.shallow(frugal, 0)
        made = [t for t in [*own, shallow, first, split] if isinstance(t, ActivationTrace)]
        if len(made) < len(own) + 3:  # a split cx refuses
            continue
        true = predict_memory_from_traces(candidate, made[: len(own)], shape.parameters).peak
        floor = states_floor(shape, candidate)
        bounds = [[floor], [with_states_floor(made[0], floor)]]
        bounds += [[with_states_floor(floor_trace(candidate, t), floor)] for t in made[-3:]]
        for traces in bounds:
            assert predict_memory_from_traces(candidate, traces, shape.parameters).peak <= true, candidate
        checked += 1
    assert checked > 15


def test_pipelined_splits_share_one_per_layer_slope(tmp_path: Path) -> None:
    """Every stage of every pp > 1 split that is otherwise the same and holds the same ends of the model adds the same
    per decoder layer: the cache traces the deeper model once per stage role, and each stage's extrapolated trace
    equals its own two traces'. The vocabulary is large enough that the head makes the last stage's peak (and a
    zero-bubble V's middle stage, holding neither end, peaks elsewhere): one slope for all was off there (+/-)."""
    config = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 20, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(str(tmp_path))
    seq = 64
    cache = TraceCache(shape, seq)
    splits = [(Candidate("hybrid", pp=pp, precision="fp32", checkpoint_ratio=ratio), stage)
              for ratio in (0.0, 1.0) for pp in (2, 4) for stage in sorted({0, 1, pp - 1})]  # fmt: skip
    splits += [(Candidate("hybrid", pp=2, precision="fp32", checkpoint_ratio=ratio, pp_style="zbv",
                          num_microbatches=2), stage) for ratio in (0.0, 1.0) for stage in (0, 1)]  # fmt: skip
    for candidate, stage in splits:
        shared = cache.get(candidate, stage)
        assert isinstance(shared, ActivationTrace)
        assert shared == trace_stage(shape, candidate, seq, stage), (candidate, stage)
    # a shallow trace per stage; per checkpointing choice one deeper trace per role: 1F1B first / middle / last, the
    # zero-bubble V's both-ends stage 0 and its middle stage
    assert cache.made == len(splits) + 2 * 5
    half = Candidate("hybrid", pp=2, precision="fp32", checkpoint_ratio=0.5)
    assert slope_key(half, 0) != slope_key(half, 1)  # the stage's depth picks which layers recompute: not shared
