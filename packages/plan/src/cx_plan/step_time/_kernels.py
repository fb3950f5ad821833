"""`Kernels`: how fast the step's kernels run beyond `efficiency` (the achievable fraction of the bf16 peak):
torch.compile as a stated factor on the forward and backward compute, and the linear layers' matmuls in fp8 at a
stated fraction of the device's fp8 peak.

Both defaults are fitted to one published run, torchtitan's Llama 3.1 8B on 8 H100 (FSDP2 per block, local batch 2,
seq 8192, selective op checkpointing; `benchmarks/llama3_h100_202412_torchtitan.md`, Table 1), on cx-plan's
`h100_96gb` row (those runs' 500 W, 96 GB HBM2e H100, whose achievable fraction of peak is fitted to the table's
eager run), and checked on the runs they were not fitted to in benchmarks/plan/RESULTS.md ("Tokens per second per
GPU"):

- `COMPILE_SPEEDUP`: eager 5,762 tokens/s per GPU, compiled 6,667, a factor of 1.157 on the whole step; cx-plan's
  step for that run is compute (the FSDP collectives hide under it) but for the AdamW step, so the factor on the
  compute alone is a little larger: 1.158 (`benchmarks/plan/published_tps.py` solves for it).
- `FP8_EFFICIENCY`: compiled + Float8 8,532 tokens/s per GPU. torchao's Float8 (dynamic tensorwise scaling) runs
  every `nn.Linear` of the decoder layers in fp8, not attention and not the output head (cx's `use_fp8` skips
  `lm_head` the same way); the fraction of the fp8 peak that reproduces the published gain is what the linear
  layers reach with their amax and cast kernels included, well below the bf16 matmuls' `efficiency`: 0.287
  (524 TFLOP/s on that row's assumed 1,824, 1.44x its bf16 matmuls' 365 at efficiency 0.40; the datasheets' ratio
  is 2). Until issue 36 it was fitted on the `h100` (SXM) row at 45 %: 0.323 of 1,979, the same 1.4x ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPILE_SPEEDUP", "EAGER", "FP8_EFFICIENCY", "Kernels"]

COMPILE_SPEEDUP = 1.16  # fitted: torchtitan Table 1, FSDP + torch.compile against FSDP (module docstring)
FP8_EFFICIENCY = 0.29  # fitted: torchtitan Table 1, + Float8 against FSDP + torch.compile (module docstring)


@dataclass(frozen=True)
class Kernels:
    """`compile_speedup`: the forward and backward compute (recompute included) runs this many times faster than
    eager (1: eager; cx-train's --compile). `fp8_efficiency`: None keeps the linear layers in the candidate's
    precision; a fraction runs the decoder layers' linear FLOPs at that fraction of the device's fp8 peak (cx-train's
    --fp8, torchao's Float8), the rest (attention, the output head) at `efficiency` x the bf16 peak as before."""

    compile_speedup: float = 1.0
    fp8_efficiency: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.compile_speedup, int | float) and self.compile_speedup > 0):
            raise ValueError(f"compile_speedup must be a positive factor (1: eager), got {self.compile_speedup!r}")
        fp8 = self.fp8_efficiency
        if fp8 is not None and not (isinstance(fp8, int | float) and 0 < fp8 <= 1):
            raise ValueError(f"fp8_efficiency must be a fraction of the fp8 peak in (0, 1], got {fp8!r}")

    @property
    def fp8(self) -> bool:
        """Whether the linear layers' matmuls run in fp8."""
        return self.fp8_efficiency is not None


EAGER = Kernels()
