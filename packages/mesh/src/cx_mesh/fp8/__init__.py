"""cx_mesh.fp8: fp8 matmuls and fp8-compressed collectives, the shared base of cx's `use_fp8` and
`fp8_communication`.

- `quantize` / `Fp8Tensor`: dynamic scaling (one scale per tensor, per row, or per tile: BLOCKWISE's
  `ACTIVATION_TILE` 1x128 and `WEIGHT_BLOCK` 128x128) into E4M3 or E5M2.
- `fp8_linear`: F.linear with fp8 GEMMs (torch._scaled_mm) forward and backward; `Fp8Linear` and `convert_to_fp8`
  swap plain nn.Linear layers that `fp8_eligible` accepts; `fp8_matmul_supported(device)` says where it runs.
  `fp8_linear_input_grad` / `fp8_linear_weight_grad`: its two backward GEMMs, for code that runs them piece by piece.
- `all_gather_flat_fp8`, `reduce_scatter_flat_fp8`, `all_reduce_fp8`, `all_to_all_single_fp8`: cx_mesh's flat
  collectives with an fp8 payload and its float32 scales on the wire (half of bf16's bytes plus 4 per scale);
  `reduce_scatter_scratch_nbytes_fp8` for memory accounting. A group of one rank copies exactly (no fp8).
  `all_reduce_fp8_segments`: the all-reduce with each segment (parameter) of a flat buffer scaled and sliced on its
  own, so its rounding does not depend on the buffer's layout (torch DDP's rebuilt buckets).
- `pack_fp8` / `unpack_fp8` / `packed_fp8_nbytes`: the wire format of one tensor (fp8 payload bytes, then its
  float32 scale, as one uint8 message), for transports of cx's own (cx_pipeline's fp8 p2p).
It lives in cx-mesh because every package needs it and mesh is the bottom layer.
"""

from cx_mesh.fp8._collectives import (
    all_gather_flat_fp8,
    all_reduce_fp8,
    all_to_all_single_fp8,
    reduce_scatter_flat_fp8,
    reduce_scatter_scratch_nbytes_fp8,
)
from cx_mesh.fp8._formats import ACTIVATION_TILE, E4M3, E5M2, WEIGHT_BLOCK, Fp8Tensor, ScalingRecipe, quantize
from cx_mesh.fp8._linear import Fp8Linear, convert_to_fp8
from cx_mesh.fp8._matmul import fp8_linear, fp8_linear_input_grad, fp8_linear_weight_grad, fp8_matmul_supported
from cx_mesh.fp8._options import Fp8Options, fp8_eligible
from cx_mesh.fp8._segments import all_reduce_fp8_segments
from cx_mesh.fp8._wire import pack_fp8, packed_fp8_nbytes, unpack_fp8

__all__ = [
    "ACTIVATION_TILE",
    "E4M3",
    "E5M2",
    "Fp8Linear",
    "Fp8Options",
    "Fp8Tensor",
    "ScalingRecipe",
    "all_gather_flat_fp8",
    "all_reduce_fp8",
    "all_reduce_fp8_segments",
    "all_to_all_single_fp8",
    "convert_to_fp8",
    "fp8_eligible",
    "fp8_linear",
    "fp8_linear_input_grad",
    "fp8_linear_weight_grad",
    "fp8_matmul_supported",
    "pack_fp8",
    "packed_fp8_nbytes",
    "quantize",
    "reduce_scatter_flat_fp8",
    "reduce_scatter_scratch_nbytes_fp8",
    "unpack_fp8",
    "WEIGHT_BLOCK",
]
