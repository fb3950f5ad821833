"""cx-plan's tokens per second per GPU and peak memory beside torchtitan's published runs. Fits each device row's
achievable fraction of peak (`Device.efficiency`) to ONE run of that device (role "efficiency fit ..."), then
torch.compile's factor and fp8's gain over the achieved bf16 rate to Table 1's ratios, and predicts every other run
("held out") with the values the code holds.

Run: `HF_HUB_OFFLINE=1 .nox/tests/bin/python benchmarks/plan/published_tps.py` (CPU, a few minutes: one FakeTensor
trace per distinct model, sequence length and layout). Prints the fitted factors and the RESULTS.md table.

Sources: torchtitan `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan 9dec370, 2024-12-26; H100 96 GB HBM2e
at 500 W, a peak between SXM's and NVL's that torchtitan does not know; TPS/GPU read at step 90; memory the reserved
peak, the maximum over GPUs) and `docs/performance.md` (2024; 64 A100 80 GB, FSDP2, bf16 with fp32 reduction; WPS
per GPU, no torch.compile or Float8: the train configs' defaults then). The H100 runs use cx-plan's `h100_96gb` row
(that part: 912 / 1,824 TFLOP/s bf16 / fp8 assumed, 2.4 TB/s, 400 Gb/s per GPU), the A100 runs its `a100` row (SXM
80 GB, 312 TFLOP/s, HDR 200 Gb/s per GPU: the cluster is not described). Tokens/s per GPU predicted = global tokens
of a step / predicted step time / GPUs. Memory predicted = the traced peak (allocated bytes), as `cx-plan` prints.
No assertion: this is a report (tests/test_plan_published.py checks the stable rows).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cx_plan import Candidate, load_model_shape
from cx_plan._devices import lookup_device
from cx_plan._planner import traced_memory_model
from cx_plan.step_time._kernels import COMPILE_SPEEDUP, FP8_GAIN, Kernels
from cx_plan.step_time._step_time import predict_step_time
from cx_plan.trace._model_spec import ModelShape
from cx_plan.trace._op_counts import OpCounter, op_counter

HERE = Path(__file__).resolve().parent
GIB = 2**30
TARGET = 0.20  # the bar for tokens/s per GPU


@dataclass(frozen=True)
class Run:
    """One published run: cx's nearest candidate, whether it compiles / runs fp8, the published figures."""

    name: str
    config: str
    seq: int
    device: str
    candidate: Candidate
    compiled: bool
    fp8: bool
    tps: float  # published tokens/s per GPU
    memory_gib: float | None  # published reserved peak, None where not published
    role: str  # "efficiency fit <device>", "fit compile", "fit fp8" or "held out"
    note: str = ""


def _fsdp(gpus: int, local_batch: int, mode: str) -> Candidate:
    """torchtitan's FSDP2: one fully_shard per block and the root, bf16 parameters, fp32 reduction."""
    ratio, how = {"op": (1.0, "selective-op"), "full": (1.0, "full"), "none": (0.0, "full")}[mode]
    return Candidate(
        "torch_fsdp", dp=gpus, micro_batch_size=local_batch, precision="bf16", checkpoint_ratio=ratio,
        checkpoint_mode=how, fsdp_wrap="block",
    )  # fmt: skip


_8B, _70B3, _70B2, _13B = "llama3_1_8b", "llama3_70b", "llama2_70b", "llama2_13b"
T = "torchtitan llama3_h100_202412"
H100 = "h100_96gb"  # the benchmark's 500 W, 96 GB HBM2e H100 (cx_plan._devices)
RUNS = [
    Run(f"{T} T1 8B, 8 H100, FSDP", _8B, 8192, H100, _fsdp(8, 2, "op"), False, False, 5762, 82.4,
        "efficiency fit h100_96gb"),
    Run(f"{T} T1 8B, 8 H100, FSDP + compile", _8B, 8192, H100, _fsdp(8, 2, "op"), True, False, 6667, 77.0,
        "fit compile"),
    Run(f"{T} T1 8B, 8 H100, FSDP + compile + Float8", _8B, 8192, H100, _fsdp(8, 2, "op"), True, True, 8532,
        76.8, "fit fp8"),
    Run(f"{T} T3 8B, 128 H100, FSDP", _8B, 8192, H100, _fsdp(128, 2, "op"), False, False, 5605, 67.0,
        "held out"),
    Run(f"{T} T3 8B, 128 H100, FSDP + compile", _8B, 8192, H100, _fsdp(128, 2, "op"), True, False, 6514, 62.0,
        "held out"),
    Run(f"{T} T3 8B, 128 H100, FSDP + compile + Float8", _8B, 8192, H100, _fsdp(128, 2, "op"), True, True, 8380,
        61.8, "held out"),
    Run(f"{T} T2 8B, 8 H100, FSDP 8 CP 1, seq 32768, full AC, compile + Float8", _8B, 32768, H100,
        _fsdp(8, 1, "full"), True, True, 3890, 83.9, "held out"),
    Run(f"{T} T4 3.1 70B, 256 H100, FSDP 32 TP 8, full AC, compile + Float8", _70B3, 8192, H100,
        Candidate("hybrid", dp=32, tp=8, sp_mode="split_gather", zero_stage=1, micro_batch_size=16,
                  precision="bf16", checkpoint_ratio=1.0), True, True, 829, 71.9, "held out",
        "cx's nearest: hybrid dp32 tp8 split_gather ZeRO 1 (no FSDP under TP in cx): memory not comparable"),
    Run("torchtitan performance.md Llama 3 8B, 64 A100, mb1, selective op", _8B, 8192, "a100", _fsdp(64, 1, "op"),
        False, False, 2973, None, "efficiency fit a100"),
    Run("torchtitan performance.md Llama 3 70B, 64 A100, mb1, full", _70B3, 8192, "a100", _fsdp(64, 1, "full"),
        False, False, 331, None, "held out"),
    Run("torchtitan performance.md Llama 2 13B, 64 A100, mb2, no AC", _13B, 4096, "a100", _fsdp(64, 2, "none"),
        False, False, 2162, None, "held out"),
    Run("torchtitan performance.md Llama 2 13B, 64 A100, mb2, selective op", _13B, 4096, "a100",
        _fsdp(64, 2, "op"), False, False, 1904, None, "held out"),
    Run("torchtitan performance.md Llama 2 70B, 64 A100, mb1, selective op", _70B2, 4096, "a100",
        _fsdp(64, 1, "op"), False, False, 355, None, "held out"),
    Run("torchtitan performance.md Llama 2 70B, 64 A100, mb2, full", _70B2, 4096, "a100", _fsdp(64, 2, "full"),
        False, False, 353, None, "held out"),
]  # fmt: skip


class Predictor:
    """Tokens/s per GPU and the traced peak of a run, the traces shared between runs of the same model and length."""

    def __init__(self) -> None:
        self._shapes: dict[str, ModelShape] = {}
        self._counters: dict[tuple[str, int], OpCounter] = {}
        self._peaks: dict[tuple[str, int, str, Candidate], int] = {}

    def shape(self, config: str) -> ModelShape:
        if config not in self._shapes:
            self._shapes[config] = load_model_shape(str(HERE / f"{config}_config.json"))
        return self._shapes[config]

    def tps(self, run: Run, compile_speedup: float, fp8_gain: float, efficiency: float | None = None) -> float:
        """Predicted tokens/s per GPU with the given factors (each only where the run uses it) and achievable
        fraction of peak (None: the device row's)."""
        shape, device = self.shape(run.config), lookup_device(run.device)
        key = (run.config, run.seq)
        if key not in self._counters:
            self._counters[key] = op_counter(shape, run.seq, exact=False)
        ops = self._counters[key](run.candidate)
        kernels = Kernels(compile_speedup if run.compiled else 1.0, fp8_gain if run.fp8 else None)
        step = predict_step_time(run.candidate, shape, run.seq, device, None, efficiency, ops, kernels)
        return step.tokens_per_s / run.candidate.world_size

    def peak_gib(self, run: Run) -> float:
        key = (run.config, run.seq, run.device, run.candidate)
        if key not in self._peaks:
            memory = traced_memory_model(self.shape(run.config), run.seq, lookup_device(run.device))
            self._peaks[key] = memory(run.candidate).peak_bytes
        return self._peaks[key] / GIB


def _solve(error: Callable[[float], float], low: float, high: float) -> float:
    """The root of a monotone `error` in [low, high] by bisection (to 1e-6)."""
    for _ in range(60):
        middle = (low + high) / 2
        if (error(low) < 0) == (error(middle) < 0):
            low = middle
        else:
            high = middle
    return (low + high) / 2


def fit_efficiency(predictor: Predictor, device: str) -> float:
    """The achievable fraction of `device`'s peak at which its one calibration run's predicted tokens/s per GPU is
    the published figure (eager, bf16: the run's own kernels)."""
    run = next(r for r in RUNS if r.role == f"efficiency fit {device}")
    return _solve(lambda e: predictor.tps(run, 1.0, 1.0, e) - run.tps, 0.05, 0.85)


def fit(predictor: Predictor, efficiency: float) -> tuple[float, float]:
    """(compile speedup, fp8 gain) that reproduce the published ratios of Table 1's three rows, at the H100
    row's achievable fraction `efficiency`."""
    roles = (f"efficiency fit {H100}", "fit compile", "fit fp8")
    eager, compiled, fp8 = (next(r for r in RUNS if r.role == role) for role in roles)
    base = predictor.tps(eager, 1.0, 1.0, efficiency)
    speedup = _solve(lambda k: predictor.tps(compiled, k, 1.0, efficiency) / base - compiled.tps / eager.tps, 1.0, 2.0)
    with_compile = predictor.tps(compiled, speedup, 1.0, efficiency)
    gain = _solve(
        lambda g: predictor.tps(fp8, speedup, g, efficiency) / with_compile - fp8.tps / compiled.tps, 1.0, 2.0
    )
    return speedup, gain


def table(predictor: Predictor, speedup: float, gain: float) -> tuple[str, dict[str, list[bool]]]:
    """The RESULTS.md table at the code's values, and whether each row is within 20 % by kind of role."""
    lines = [
        "| published run | role | memory published (reserved) | cx-plan (allocated) | off by | TPS/GPU published "
        "| cx-plan | off by | within 20 % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    within: dict[str, list[bool]] = {"calibration": [], "held out": []}
    for run in RUNS:
        predicted = predictor.tps(run, speedup, gain)
        off = predicted / run.tps - 1
        within["held out" if run.role == "held out" else "calibration"].append(abs(off) <= TARGET)
        peak = predictor.peak_gib(run)
        if run.memory_gib is None:
            memory = f"not published | {peak:.1f} GiB | "
        else:
            memory = f"{run.memory_gib:.1f} GiB | {peak:.1f} GiB | {peak / run.memory_gib - 1:+.1%}"
        lines.append(
            f"| {run.name} | {run.role} | {memory} | {run.tps:,.0f} | {predicted:,.0f} | {off:+.1%} | "
            f"{'yes' if abs(off) <= TARGET else 'no'} |"
        )
    return "\n".join(lines), within


def main() -> None:
    predictor = Predictor()
    for device in (H100, "a100"):
        print(f"{device}: efficiency fitted {fit_efficiency(predictor, device):.4f}, in the code "
              f"{lookup_device(device).efficiency}")  # fmt: skip
    speedup, gain = fit(predictor, lookup_device(H100).efficiency)
    code = f"COMPILE_SPEEDUP {COMPILE_SPEEDUP}, FP8_GAIN {FP8_GAIN}"
    print(f"fitted to Table 1 at {H100}'s efficiency: compile speedup {speedup:.4f}, fp8 gain {gain:.4f}; code: {code}")
    print()
    text, within = table(predictor, COMPILE_SPEEDUP, FP8_GAIN)
    print(text)
    for kind, rows in within.items():
        print(f"\nwithin 20 %, {kind}: {sum(rows)} of {len(rows)}", end="")
    print()


if __name__ == "__main__":
    main()
