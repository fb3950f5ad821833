"""`cx-plan --measure`: run the best configurations on this machine for a few steps and set the measured peak tensor
memory per rank and step time beside the prediction, so the planner's error is seen, not assumed.

Each configuration runs on fresh local ranks (cx_mesh.testing's `spawn`: gloo on CPU, NCCL on CUDA), with the model
cx-train builds (fresh weights from its config under a fixed seed, `fresh_model`: a folder with only a config.json
measures too), the candidate's plugin (`make_plugin`, as cx-train makes it), cx-train's accumulated step
(`cx_plugins.accumulated_step`) and torch AdamW, on deterministic token ids. The first step is a warm-up (the
optimizer states exist from then on, as in every later step); the peak is taken over the steps after it. On CPU the
peak is that of the live tensor storages (`LiveBytes`, a dispatch-level tracker entered before the model is built,
because ZeRO partitions and Gemini chunks are reachable from no module, which torch's `MemTracker` needs); the
process's peak RSS is printed for reference (it adds the interpreter, libraries and allocator caches). On CUDA the
peak is the allocator's `max_memory_allocated`.
"""

from __future__ import annotations

import gc
import json
import resource
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from cx_plan._candidate import Candidate
from cx_plan._plugin import make_plugin
from cx_plan._report import PlanReport, PlanRow, row_label
from cx_plan.trace._model_spec import ModelShape, build_model, load_model_shape
from cx_plugins import Booster, accumulated_step, enable_activation_checkpointing
from cx_zero import MuonWithAdamW, muon_param_groups

__all__ = [
    "MEASURE_SEED",
    "LiveBytes",
    "Measured",
    "fresh_model",
    "measure_candidate",
    "measure_report",
    "measure_table",
]


@dataclass(frozen=True)
class Measured:
    """One configuration's measurement: per-rank peak tensor bytes and peak RSS, the median step time."""

    candidate: Candidate
    peaks: list[int]
    rss: list[int]
    step_s: float
    error: str = ""  # the failing rank's last line when the run failed (the other fields are then empty)

    @property
    def peak(self) -> int:
        return max(self.peaks) if self.peaks else 0


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages written under it that are still alive, and their peak. Each op's outputs (and
    the arguments of in-place ops) are counted once per storage, released when the storage is freed and re-read
    when it is resized (FSDP frees its gathered flat parameters and Gemini its chunks in place, by storage resize).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        size = storage.nbytes()
        if key not in self.sizes:
            weakref.finalize(storage, self._free, key)
        self.live += size - self.sizes.get(key, 0)
        self.sizes[key] = size
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __enter__(self) -> LiveBytes:
        # FSDP and cx-chunk free and regrow storages with `UntypedStorage.resize_`, which no dispatch mode sees
        resize = self._resize = torch.UntypedStorage.resize_

        def counted(storage: torch.UntypedStorage, size: int) -> Any:
            result = resize(storage, size)
            self._count(storage)
            return result

        torch.UntypedStorage.resize_ = counted  # type: ignore[assignment,method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    def _count_tensor(self, value: torch.Tensor) -> None:
        """A plain tensor's storage; a wrapper subclass's (FSDP2's DTensor parameters, gradients, moments) inner
        tensors instead, as its own storage holds no data and is sized by its view offset: a gradient viewing the
        end of FSDP's reduce-scattered buffer counted as the whole buffer, once per parameter (torch_fsdp was
        measured at 2-3.3x its real peak)."""
        wrapper: Any = value  # torch's TypeGuard makes the subclass branch unreachable for mypy
        if is_traceable_wrapper_subclass(wrapper):
            for name in wrapper.__tensor_flatten__()[0]:
                inner = getattr(wrapper, name)
                if isinstance(inner, torch.Tensor):  # DTensor also names its (non-tensor) mesh
                    self._count_tensor(inner)
        elif value.device.type not in ("meta", "cuda") and not value.is_sparse:
            self._count(value.untyped_storage())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        written = tree_flatten(out)[0] + (tree_flatten(args)[0] if func._schema.is_mutable else [])
        for value in written:
            if isinstance(value, torch.Tensor):
                self._count_tensor(value)
        return out


def _loss(output: Any, _batch: object = None) -> torch.Tensor:
    """The loss a model returned: cx's GPT returns it as a tensor, transformers models in `.loss`."""
    return output if isinstance(output, torch.Tensor) else output.loss


MEASURE_SEED = 0


def fresh_model(shape: ModelShape, seed: int = MEASURE_SEED) -> nn.Module:
    """`shape`'s model with fresh weights drawn under `seed` (the caller's RNG state is left as it was): the same
    weights on every rank and in every run. Built from the config alone, so a folder holding only `config.json` (an
    architecture planned before there are weights) measures like any other; no weights file is ever read."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(shape)


def _prepare(candidate: Candidate, model: str, hidden: int, layers: int, seq_len: int) -> Callable[[], None]:
    shape = load_model_shape(model, hidden_size=hidden, num_layers=layers, seq_len=seq_len)
    module = fresh_model(shape)
    if candidate.checkpoint_ratio and candidate.plugin not in ("hybrid", "moe_hybrid"):
        enable_activation_checkpointing(module, candidate.checkpoint_mode)
    if torch.cuda.is_available():
        module = module.cuda()
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    if candidate.muon:  # cx-train's --optimizer muon
        optimizer = MuonWithAdamW(muon_param_groups(module), lr=1e-3)
    plugin, mixed = make_plugin(candidate, module)
    booster = Booster(plugin=plugin, mixed_precision=mixed)
    boosted, wrapped, *_ = booster.boost(module, optimizer)
    assert wrapped is not None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = candidate.micro_batch_size * (candidate.num_microbatches if candidate.pp > 1 else 1)
    ids = ((torch.arange(rows * seq_len) * 7) % shape.vocab_size).reshape(rows, seq_len).to(device)

    def step() -> None:
        if candidate.pp > 1:
            data = iter([{"input_ids": ids, "labels": ids}])
            booster.execute_pipeline(data, boosted, _loss, wrapped)
            wrapped.step()
            wrapped.zero_grad()
        else:  # cx-train's own step: gradients communicated on the last micro-batch only (booster.no_sync before)
            batches = [ids] * candidate.num_microbatches
            accumulated_step(booster, boosted, wrapped, batches, lambda m, b: _loss(m(input_ids=b, labels=b)))

    return step


def measure_rank(
    rank: int, world_size: int, *, fields: dict[str, Any], model: str, hidden: int, layers: int, seq_len: int,
    steps: int, out: str,
) -> None:  # fmt: skip
    """One rank's measurement (run by `spawn` on every rank): writes `out/<rank>.json`."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    with LiveBytes() as tracker:  # from before the model exists: every storage a plugin makes is seen
        step = _prepare(Candidate(**fields), model, hidden, layers, seq_len)
        step()  # warm-up: optimizer states, buckets and chunks exist from here on
        gc.collect()  # the warm-up's garbage in reference cycles, freed now rather than whenever the collector runs
        tracker.reset_peak()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            gc.collect()  # each step measured from the same start (a measured 14 % more in one of ten runs without)
            dist.barrier()
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            dist.barrier()
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else tracker.peak
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    Path(out, f"{rank}.json").write_text(json.dumps({"peak": peak, "rss": rss, "step_s": statistics.median(times)}))


def measure_candidate(
    candidate: Candidate, model: str, *, hidden: int = 128, layers: int = 2, seq_len: int = 128, steps: int = 3,
    timeout: float = 600.0,
) -> Measured:  # fmt: skip
    """Run `candidate` on `candidate.world_size` fresh local ranks for 1 + `steps` steps; a failed run comes back
    with `error` set rather than raising, so one configuration cx cannot run does not hide the others."""
    from cx_mesh.testing import spawn

    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    world = candidate.world_size
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        raise ValueError(f"measuring {row_label(candidate)} needs {world} GPUs, this machine has "
                         f"{torch.cuda.device_count()}")  # fmt: skip
    fields = {name: getattr(candidate, name) for name in candidate.__dataclass_fields__}
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    with tempfile.TemporaryDirectory(prefix="cx-plan-measure-") as out:
        try:
            spawn(measure_rank, world, backend=backend, timeout=timeout, fields=fields, model=model, hidden=hidden,
                  layers=layers, seq_len=seq_len, steps=steps, out=out)  # fmt: skip
        except AssertionError as failure:  # DistributedTestFailure: the ranks' tracebacks
            lines = [line for line in str(failure).splitlines() if line.strip()]
            return Measured(candidate, [], [], 0.0, error=lines[-1] if lines else "failed")
        results = [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]
    step_s = max(result["step_s"] for result in results)
    return Measured(candidate, [r["peak"] for r in results], [r["rss"] for r in results], step_s)


def _mb(count: float) -> str:
    return f"{count / 1e6:.2f}"


def _ranks(values: Sequence[float]) -> list[int]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0] * len(values)
    for place, index in enumerate(order, 1):
        ranks[index] = place
    return ranks


def measure_table(rows: Sequence[PlanRow], measured: Sequence[Measured]) -> str:
    """Predicted vs measured, one line per configuration: peak tensor MB per rank (the busiest), the error, peak RSS,
    step ms, and the rank by predicted and by measured step time among the configurations that ran."""
    kind = "CUDA allocator peak" if torch.cuda.is_available() else "live tensor storages"
    lines = [
        f"cx-plan --measure: predicted vs measured on this machine (memory: {kind}; RSS for reference)",
        f"{'configuration':<52} {'pred MB':>8} {'meas MB':>8} {'error':>7} {'RSS MB':>8} "
        f"{'pred ms':>9} {'meas ms':>9} {'rank p/m':>8}",
    ]
    ran = [i for i, m in enumerate(measured) if not m.error]
    predicted_rank = dict(zip(ran, _ranks([rows[i].step.step_s for i in ran]), strict=True))
    measured_rank = dict(zip(ran, _ranks([measured[i].step_s for i in ran]), strict=True))
    for index, (row, result) in enumerate(zip(rows, measured, strict=True)):
        label = row_label(row.candidate)
        if result.error:
            lines.append(f"{label:<52} {_mb(row.memory.peak_bytes):>8} failed: {result.error}")
            continue
        error = (row.memory.peak_bytes - result.peak) / result.peak if result.peak else 0.0
        lines.append(
            f"{label:<52} {_mb(row.memory.peak_bytes):>8} {_mb(result.peak):>8} {error:>+7.1%} "
            f"{_mb(max(result.rss)):>8} {row.step.step_s * 1e3:>9.1f} {result.step_s * 1e3:>9.1f} "
            f"{predicted_rank[index]:>4}/{measured_rank[index]:<3}"
        )
    return "\n".join(lines)


def measure_report(
    report: PlanReport, model: str, *, hidden: int, layers: int, top: int, steps: int
) -> tuple[list[PlanRow], list[Measured]]:
    """Measure the `top` fitting configurations of `report` (best predicted first), printing progress to stderr."""
    rows = [row for row in report.rows if row.memory.fits][:top]
    if not rows:
        raise ValueError("cx-plan --measure: no configuration fits, so there is nothing to measure")
    measured = []
    for row in rows:
        print(f"cx-plan: measuring {row_label(row.candidate)} ...", file=sys.stderr, flush=True)
        measured.append(
            measure_candidate(row.candidate, model, hidden=hidden, layers=layers, seq_len=report.seq_len, steps=steps)
        )
    return rows, measured
