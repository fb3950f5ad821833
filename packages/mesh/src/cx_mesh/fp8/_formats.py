"""fp8 formats and dynamic scaling: `quantize` turns a tensor into an `Fp8Tensor` (fp8 payload plus float32 scales).

Dynamic scaling maps each tensor's (or row's, or tile's) largest magnitude onto the format's largest finite value,
so the payload uses the format's whole range and its relative error is the format's unit roundoff (2^-4 for e4m3,
2^-3 for e5m2) for every element not below the format's subnormal range after scaling. The finer the scale group,
the fewer elements an outlier pushes down into the subnormal range (BLOCKWISE: one outlier costs 128 or 128x128
elements their precision, not a row or the whole tensor).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ACTIVATION_TILE", "E4M3", "E5M2", "WEIGHT_BLOCK", "Fp8Tensor", "ScalingRecipe", "quantize"]

#: Forward operands (activations, weights) and gathered parameters: 3 mantissa bits, max 448.
E4M3: torch.dtype = torch.float8_e4m3fn
#: Gradients: 2 mantissa bits but a wider range (max 57344).
E5M2: torch.dtype = torch.float8_e5m2

FP8_DTYPES = (E4M3, E5M2)

#: The smallest scale: float32's smallest normal number (2^-126), i.e. amax is clamped below at fmax * 2^-126. All-zero
#: input gives zeros, not 0/0 = NaN; the scale is never a subnormal (which GPU kernels flush to zero); and values down
#: to 2^-126 times the format's smallest subnormal (2^-135 for E4M3) are still represented.
MIN_SCALE = torch.finfo(torch.float32).tiny


#: BLOCKWISE's scale group for activations and gradients: 1 row x 128 columns (per token per 128 channels, along
#: the GEMM's reduction dim), DeepSeek-V3's fine-grained quantization.
ACTIVATION_TILE: tuple[int, int] = (1, 128)
#: BLOCKWISE's scale group for weights: 128 x 128 blocks (per 128 output by 128 input features), so the transposed
#: weight of the backward GEMM has the same blocks and scales.
WEIGHT_BLOCK: tuple[int, int] = (128, 128)


class ScalingRecipe(enum.Enum):
    """How scales are taken: one per tensor, one per row (per token / per output feature), or one per tile
    (BLOCKWISE: `ACTIVATION_TILE` for activations and gradients, `WEIGHT_BLOCK` for weights)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"


@dataclass(frozen=True)
class Fp8Tensor:
    """An fp8 payload and the float32 scales that travel with it: value ~= data.float() * scale.

    `scale` has shape () (tensorwise), (rows, 1) for the rows of data.reshape(-1, data.shape[-1]) (rowwise), or, with
    `tile` (blockwise), (ceil(rows / tile[0]), ceil(cols / tile[1])) for that 2-D view, the last tile of a dim
    covering its remainder.
    """

    data: torch.Tensor
    scale: torch.Tensor
    tile: tuple[int, int] | None = None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The high-precision value (float32 arithmetic, then `dtype`), in `data`'s shape."""
        values = self.data.float()
        if self.scale.dim() == 0:
            return (values * self.scale).to(dtype)
        if self.tile is not None:
            rows = values.reshape(-1, values.shape[-1])
            scale = self.scale.repeat_interleave(self.tile[0], 0).repeat_interleave(self.tile[1], 1)
            return (rows * scale[: rows.shape[0], : rows.shape[1]]).reshape(self.data.shape).to(dtype)
        rows = values.reshape(-1, values.shape[-1]) if values.dim() else values.reshape(1, 1)
        return (rows * self.scale).reshape(self.data.shape).to(dtype)


def check_fp8_dtype(dtype: torch.dtype) -> None:
    """Raise a clear error for a dtype that is not one of cx's two fp8 formats."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be E4M3 (torch.float8_e4m3fn) or E5M2 (torch.float8_e5m2), got {dtype}")


def _tile_amax(rows: torch.Tensor, tile: tuple[int, int]) -> torch.Tensor:
    """The largest magnitude of each `tile` of a 2-D tensor, (ceil(R / tile[0]), ceil(C / tile[1])); the
    remainder tiles are zero-padded, which leaves their amax alone."""
    tile_rows, tile_cols = -(-rows.shape[0] // tile[0]), -(-rows.shape[1] // tile[1])
    padded = F.pad(rows.abs(), (0, tile_cols * tile[1] - rows.shape[1], 0, tile_rows * tile[0] - rows.shape[0]))
    if padded.numel() == 0:
        return rows.new_zeros(tile_rows, tile_cols)
    return padded.reshape(tile_rows, tile[0], tile_cols, tile[1]).amax(dim=(1, 3))


def _check_tile(tile: tuple[int, int]) -> None:
    if not (isinstance(tile, tuple) and len(tile) == 2 and all(isinstance(d, int) and d >= 1 for d in tile)):
        raise ValueError(f"quantize: tile must be a (rows, cols) tuple of two positive ints, got {tile!r}")


def quantize(
    tensor: torch.Tensor,
    dtype: torch.dtype = E4M3,
    recipe: ScalingRecipe = ScalingRecipe.TENSORWISE,
    tile: tuple[int, int] | None = None,
) -> Fp8Tensor:
    """Dynamic scaling: scale = amax / finfo(dtype).max, amax clamped below at finfo(dtype).max * `MIN_SCALE`
    (all-zero input gives zeros, not NaN). ROWWISE takes amax per row of tensor.reshape(-1, tensor.shape[-1]);
    BLOCKWISE per `tile` of that 2-D view (default `ACTIVATION_TILE`; `WEIGHT_BLOCK` for weights), shapes that are
    not multiples of the tile getting smaller remainder tiles. A non-finite input gives a non-finite result after
    dequantize (an inf amax makes the scale inf, and 0 * inf or inf / inf is NaN), so fp16 overflow checks after a
    compressed collective still see it."""
    check_fp8_dtype(dtype)
    if not (tensor.is_floating_point() and tensor.dtype not in FP8_DTYPES):
        raise TypeError(f"quantize takes a float16/bfloat16/float32/float64 tensor, got {tensor.dtype}")
    if not isinstance(recipe, ScalingRecipe):
        raise TypeError(f"recipe must be a ScalingRecipe, got {recipe!r}")
    if tile is not None and recipe is not ScalingRecipe.BLOCKWISE:
        raise ValueError(f"quantize: tile is BLOCKWISE's scale group, not {recipe.name}'s")
    fmax = torch.finfo(dtype).max
    values = tensor.float()
    if recipe is ScalingRecipe.TENSORWISE:
        amax = values.abs().amax() if values.numel() else values.new_zeros(())
    elif recipe is ScalingRecipe.BLOCKWISE:
        tile = ACTIVATION_TILE if tile is None else tile
        _check_tile(tile)
        if tensor.dim() == 0:
            raise ValueError("BLOCKWISE quantize needs a tensor with at least one dimension (tiles of its last dim)")
        rows = values.reshape(-1, values.shape[-1])
        scale = _tile_amax(rows, tile).clamp(min=fmax * MIN_SCALE) / fmax
        expanded = scale.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)[: rows.shape[0], : rows.shape[1]]
        data = (rows / expanded).clamp_(-fmax, fmax).to(dtype).reshape(tensor.shape)
        return Fp8Tensor(data, scale, tile)
    else:
        if tensor.dim() == 0:
            raise ValueError("ROWWISE quantize needs a tensor with at least one dimension (rows of its last dim)")
        rows = values.reshape(-1, values.shape[-1])
        empty_rows = rows.shape[-1] == 0
        amax = rows.new_zeros(rows.shape[0], 1) if empty_rows else rows.abs().amax(dim=-1, keepdim=True)
        values = rows
    scale = amax.clamp(min=fmax * MIN_SCALE) / fmax
    # clamp: the division can round a hair above fmax, and e4m3fn has no inf to saturate to (NaN stays NaN)
    scaled = values / scale  # a new tensor, so clamping it in place leaves the input alone
    data = scaled.clamp_(-fmax, fmax).to(dtype).reshape(tensor.shape)
    return Fp8Tensor(data, scale)
