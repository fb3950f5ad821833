"""`Kernels`: how fast the step's kernels run beyond `efficiency` (the achievable fraction of the bf16 peak):
torch.compile as a stated factor on the forward and backward compute, and the linear layers' matmuls in fp8 at a
stated gain over the row's achieved bf16 rate.

Both defaults are fitted to one published run, torchtitan's Llama 3.1 8B on 8 H100 (FSDP2 per block, local batch 2,
seq 8192, selective op checkpointing; `benchmarks/llama3_h100_202412_torchtitan.md`, Table 1), on cx-plan's
`h100_96gb` row (those runs' 500 W, 96 GB HBM2e H100, whose achievable fraction of peak is fitted to the table's
eager run), and checked on the runs they were not fitted to in benchmarks/plan/RESULTS.md ("Tokens per second per
GPU"):

- `COMPILE_SPEEDUP`: eager 5,762 tokens/s per GPU, compiled 6,667, a factor of 1.157 on the whole step; cx-plan's
  step for that run is compute (the FSDP collectives hide under it) but for the AdamW step, so the factor on the
  compute alone is a little larger: 1.158 (`benchmarks/plan/published_tps.py` solves for it).
- `FP8_GAIN`: compiled + Float8 8,532 tokens/s per GPU. torchao's Float8 (dynamic tensorwise scaling) runs every
  `nn.Linear` of the decoder layers in fp8, not attention and not the output head (cx's `use_fp8` skips `lm_head`
  the same way). The gain is the rate those linear FLOPs reach in fp8 over the row's own achieved bf16 rate
  (`efficiency` x its bf16 peak), amax and cast kernels included: 1.44 on Table 1 (524 TFLOP/s against the
  `h100_96gb` row's 365 at efficiency 0.40; the datasheets' fp8 / bf16 ratio is 2, which caps it: the fp8 rate is
  at most `efficiency` x the fp8 peak). Stated as a gain over the bf16 rate, not a fraction of the fp8 peak, so that
  a row with another efficiency or peak (`h100`, `h200` at 45 % of 989) keeps the published ratio of fp8 to
  compiled bf16 instead of inheriting the fitted row's. Before issue 36's review it was a fraction of the fp8 peak
  (0.32, then 0.29 refitted on `h100_96gb`, which moved `h100`'s fp8 gain from 1.42 to 1.29).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPILE_SPEEDUP", "EAGER", "FP8_GAIN", "Kernels"]

COMPILE_SPEEDUP = 1.16  # fitted: torchtitan Table 1, FSDP + torch.compile against FSDP (module docstring)
FP8_GAIN = 1.44  # fitted: torchtitan Table 1, + Float8 against FSDP + torch.compile (module docstring)


@dataclass(frozen=True)
class Kernels:
    """`compile_speedup`: the forward and backward compute (recompute included) runs this many times faster than
    eager (1: eager; cx-train's --compile). `fp8_gain`: None keeps the linear layers in the candidate's precision; a
    gain runs the decoder layers' linear FLOPs at that multiple of `efficiency` x the bf16 peak, at most `efficiency`
    x the fp8 peak (cx-train's --fp8, torchao's Float8), the rest (attention, the output head) at `efficiency` x the
    precision's peak as before."""

    compile_speedup: float = 1.0
    fp8_gain: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.compile_speedup, int | float) and self.compile_speedup > 0):
            raise ValueError(f"compile_speedup must be a positive factor (1: eager), got {self.compile_speedup!r}")
        fp8 = self.fp8_gain
        if fp8 is not None and not (isinstance(fp8, int | float) and fp8 > 0):
            raise ValueError(f"fp8_gain must be a positive factor over the bf16 rate, got {fp8!r}")

    @property
    def fp8(self) -> bool:
        """Whether the linear layers' matmuls run in fp8."""
        return self.fp8_gain is not None


EAGER = Kernels()
