"""Gemini: chunk-based ZeRO-3 for any PyTorch module (ColossalAI's GeminiDDP / GeminiOptimizer arguments).

- `GeminiDDP(module, ...)`: parameters packed into cx-chunk chunks, sharded over the zero group, gathered just
  before each module runs (forward and backward) and released after; gradients reduce-scattered chunk by chunk.
- `GeminiOptimizer(optimizer, module, ...)`: steps any elementwise torch optimizer on each rank's fp32 master
  shard; fp16 dynamic loss scaling, clipping by global norm (2 and inf).
- `GeminiOptions` (`GeminiOptions.from_arguments`: ColossalAI's GeminiDDP keywords -> the group),
  `GeminiOptimizerOptions`, `PlacementKind`: the validated options, taken whole by `GeminiDDP(options=...)` and
  `GeminiOptimizer(options=...)`; `PathMismatchError`: ranks used different parameters, or the same ones in a
  different order; `OpaqueOutputError`: a module output hides tensors from torch's pytree.
- `ParameterSource`: how `GeminiDDP(module, parameter_source=...)` takes a module whose parameters are on the meta
  device (never allocated): each full value is streamed into its chunk slot, this rank's part kept.
- `GeminiWholeStep` / `WholeParam` (`GeminiOptimizer.whole_step`: a whole-tensor optimizer's owners and whole
  masters) and `SplitWholeStates`, what `GeminiOptimizer(tp_whole=...)` returns: the seam through which a caller that
  knows the tensor-parallel slicing (GeminiPlugin) steps those masters whole over tp too.
See docs/gemini.md.
"""

from cx_zero.gemini._ddp import GeminiDDP
from cx_zero.gemini._driver import PathMismatchError
from cx_zero.gemini._optimizer import GeminiOptimizer
from cx_zero.gemini._options import GeminiOptimizerOptions, GeminiOptions, PlacementKind
from cx_zero.gemini._outputs import OpaqueOutputError
from cx_zero.gemini._source import ParameterSource
from cx_zero.gemini._whole import GeminiWholeStep, SplitWholeStates, WholeParam

__all__ = [
    "GeminiDDP",
    "GeminiOptimizer",
    "GeminiOptimizerOptions",
    "GeminiOptions",
    "GeminiWholeStep",
    "OpaqueOutputError",
    "ParameterSource",
    "PathMismatchError",
    "PlacementKind",
    "SplitWholeStates",
    "WholeParam",
]
