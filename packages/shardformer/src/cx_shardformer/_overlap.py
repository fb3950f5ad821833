"""enable_sequence_overlap: split_gather's sequence all-gather and reduce-scatter overlapped with the matmuls.

Without overlap a block's sequence shard is all-gathered, then its column layers multiply the full sequence; a row
layer multiplies, then reduce-scatters. With overlap both run as a ring over the tensor-parallel group (tp - 1 async
`batch_isend_irecv` steps): each rank multiplies the sequence chunk it holds while the next chunk travels. Backward
does the same for the input gradient (a ring reduce-scatter fed by the column layers' per-chunk input gradients, a
ring all-gather of the row layer's output gradient feeding its per-chunk input gradient). Weight and bias gradients
are one matmul / sum over the whole sequence, as without overlap. One ring serves every column layer of a block (q, k
and v; gate and up), so the bytes moved equal the non-overlapped path's.

Arithmetic: each output element is the same dot product as without overlap (the matmul is split along its rows, the
sequence), and the ring adds the ranks' partial input gradients in another order than the collective; so results
agree within one summation bound of the reduced dimension (bitwise where the GEMM kernel does not change its blocking
with the row count and for tp 2, whose single addition commutes exactly).

fp8 (`use_fp8`, `fp8_communication`): each chunk's forward matmul is the layer's own (`fp8_linear` with its
recipe), and backward runs `fp8_linear`'s two GEMMs (`fp8_linear_input_grad` per chunk, `fp8_linear_weight_grad`
over the whole sequence), so the formats are those of the non-overlapped fp8 path. TENSORWISE takes one activation /
gradient scale per chunk instead of one per full sequence (another rounding, within E4M3's / E5M2's); ROWWISE and
BLOCKWISE scale per token (row, or 1 x 128 tile of it), so a chunk quantizes exactly as its rows of the full tensor.
With fp8_communication every ring step sends a `pack_fp8` message (the fp8 payload, half of bf16's bytes, plus one
float32 scale): forward payloads E4M3, gradients E5M2, as `cx_mesh.fp8`'s collectives. A gathered chunk is quantized
once by its owner and passed on unchanged, every rank (its owner included) computing with the dequantized values, so
the gathered tensor equals `all_gather_flat_fp8`'s bit for bit; a ring sum re-quantizes each partial sum it passes
on (tp - 1 times where the collective quantizes each rank's part once: the same bound at tp 2).

torch's async TP (`torch.distributed._symmetric_memory`, inductor's `micro_pipeline_tp`) fuses the same all-gather-
matmul on CUDA: it needs symmetric memory (NCCL/NVSHMEM) and torch.compile'd DTensor graphs, so it has no gloo/CPU
path and does not see cx's plain-tensor layers; cx uses this ring on every backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import ProcessGroup, named_collective
from cx_mesh.fp8 import (
    E4M3,
    E5M2,
    ScalingRecipe,
    fp8_linear_input_grad,
    fp8_linear_weight_grad,
    pack_fp8,
    unpack_fp8,
)
from cx_shardformer._comm import group_rank, group_size

__all__ = [
    "ColumnMatmul",
    "as_column",
    "check_overlap_layer",
    "clear_stash",
    "column_overlap_forward",
    "column_ring",
    "row_overlap_forward",
    "row_ring",
    "stash_outputs",
    "weights_present",
]

_STASH = "_cx_overlapped"


@dataclass(frozen=True)
class ColumnMatmul:
    """One column layer inside a ring: its forward matmul on a chunk (`matmul(chunk, bias)`), its weight in the
    layer's own layout (`linear_layout`: [out, in] as nn.Linear, else [in, out] as Conv1D) and the bias the matmul
    adds (None when there is none or the layer returns it unadded); `recipe` the layer's use_fp8 recipe (None: high
    precision), which its backward GEMMs follow."""

    matmul: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    weight: torch.Tensor
    bias: torch.Tensor | None
    linear_layout: bool
    recipe: ScalingRecipe | None = None


#: The use_fp8 recipes the ring computes (every recipe scales per chunk or per token; a new one is refused by name
#: until its per-chunk quantization is checked against the full sequence's).
RING_RECIPES = (ScalingRecipe.TENSORWISE, ScalingRecipe.ROWWISE, ScalingRecipe.BLOCKWISE)


class _Wire:
    """How a ring step's tensor travels: as it is, or (fp8_communication) as one `pack_fp8` message in `fp8`."""

    def __init__(self, fp8: torch.dtype | None) -> None:
        self.fp8 = fp8

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous() if self.fp8 is None else pack_fp8(tensor, self.fp8)

    def decode(self, message: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The values a message carries, in `like`'s shape and dtype."""
        if self.fp8 is None:
            return message
        return unpack_fp8(message, tuple(like.shape), like.dtype, self.fp8)


class _Ring:
    """This rank's place in the group's ring: sends go to the next rank, receives come from the previous one (or
    the reverse for `backwards`)."""

    def __init__(self, group: ProcessGroup | None, fp8_communication: bool = False) -> None:
        self.group, self.world, self.rank = group, group_size(group), group_rank(group)
        fp8 = fp8_communication and self.world > 1  # one rank sends nothing: exact, as cx_mesh.fp8's collectives
        self.forward_wire = _Wire(E4M3 if fp8 else None)
        self.grad_wire = _Wire(E5M2 if fp8 else None)

    def _global(self, index: int) -> int:
        index %= self.world
        return int(dist.get_global_rank(self.group, index)) if self.group is not None else index

    def start(self, send: torch.Tensor, backwards: bool = False) -> tuple[torch.Tensor, list[Any]]:
        """Start sending `send` one step along the ring; returns the receive buffer and the works to wait on."""
        step = -1 if backwards else 1
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self._global(self.rank + step), self.group),
            dist.P2POp(dist.irecv, recv, self._global(self.rank - step), self.group),
        ]
        with named_collective("sequence-overlap ring send/recv", self.group):
            works = dist.batch_isend_irecv(ops)
        return recv, works

    def wait(self, works: list[Any]) -> None:
        with named_collective("sequence-overlap ring send/recv", self.group):
            for work in works:
                work.wait()


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _input_grad(
    grad: torch.Tensor, weight: torch.Tensor, linear_layout: bool, recipe: ScalingRecipe | None, dtype: torch.dtype
) -> torch.Tensor:
    """d(input) of `input @ W^T` (linear layout) or `input @ W` (Conv1D layout); with a recipe, fp8_linear's GEMM
    (on the [out, in] view, as the layers' fp8 matmul takes it) in `dtype`, the input's."""
    linear = weight if linear_layout else weight.t()
    return grad @ linear if recipe is None else fp8_linear_input_grad(grad, linear, recipe, dtype)


def _weight_grad(
    grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, linear_layout: bool, recipe: ScalingRecipe | None
) -> torch.Tensor:
    """d(weight) over every token, in the weight's own layout (as autograd computes it without overlap)."""
    if recipe is not None:
        linear = fp8_linear_weight_grad(grad, x, recipe, weight.dtype)  # [out, in]
        return linear if linear_layout else linear.t()
    return _flat(grad).t() @ _flat(x) if linear_layout else _flat(x).t() @ _flat(grad)


def _ring_sum(ring: _Ring, wire: _Wire, part_of: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """A ring reduce-scatter fed by computation: at step k this rank computes its contribution to chunk
    (rank + k + 1) % world, adds the partial sum received from its neighbour and passes it on (through `wire`) while
    the next part is computed; the last step's chunk is this rank's own, which it keeps (sums in ring order, the same
    on every rank)."""
    world, rank = ring.world, ring.rank
    pending: tuple[torch.Tensor, list[Any]] | None = None
    for k in range(world):
        part = part_of((rank + k + 1) % world)
        if pending is not None:
            ring.wait(pending[1])
            part = part + wire.decode(pending[0], part)
        if k == world - 1:
            return part
        pending = ring.start(wire.encode(part), backwards=True)
    raise ValueError(f"a ring needs at least one rank, got {world}")


def _ring_gather(
    ring: _Ring, wire: _Wire, dim: int, x: torch.Tensor, use: Callable[[int, torch.Tensor], None]
) -> torch.Tensor:
    """A ring all-gather of `x` along `dim`: each chunk, once here, is written into the full tensor and handed to
    `use(index, chunk)` while the next one travels. Through an fp8 wire a chunk is quantized once by its owner and
    passed on as it arrived; every rank, the owner included, uses the dequantized values."""
    world, rank, length = ring.world, ring.rank, x.shape[dim]
    full = x.new_empty((*x.shape[:dim], length * world, *x.shape[dim + 1 :]))
    message = wire.encode(x)
    cur = wire.decode(message, x)
    for k in range(world):
        pending = ring.start(message) if k < world - 1 else None
        index = (rank - k) % world
        full.narrow(dim, index * length, length).copy_(cur)
        use(index, cur)
        if pending is not None:
            ring.wait(pending[1])
            message = pending[0]
            cur = wire.decode(message, x)
    return full


class _ColumnRing(torch.autograd.Function):
    """Ring all-gather of a sequence shard, each chunk multiplied by every column layer as it arrives; backward: ring
    reduce-scatter of the summed input gradients, each step's chunk computed while the previous one travels."""

    @staticmethod
    def forward(
        ctx: Any, layers: Sequence[ColumnMatmul], dim: int, ring: _Ring, x: torch.Tensor, *params: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        world, length = ring.world, x.shape[dim]
        outs: list[torch.Tensor] = []

        def multiply(index: int, chunk: torch.Tensor) -> None:
            for i, layer in enumerate(layers):
                y = layer.matmul(chunk, layer.bias)
                if len(outs) == i:
                    outs.append(y.new_empty((*y.shape[:dim], length * world, *y.shape[dim + 1 :])))
                outs[i].narrow(dim, index * length, length).copy_(y)

        full = _ring_gather(ring, ring.forward_wire, dim, x, multiply)
        ctx.layers, ctx.dim, ctx.ring = layers, dim, ring
        ctx.save_for_backward(full, *params)
        return (full, *outs)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor | None, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        full, *params = ctx.saved_tensors
        layers: Sequence[ColumnMatmul] = ctx.layers
        dim, ring = ctx.dim, ctx.ring
        length = full.shape[dim] // ring.world
        param_grads: list[torch.Tensor | None] = []
        for i, layer in enumerate(layers):
            grad = grads[i]
            want_w, want_b = ctx.needs_input_grad[4 + 2 * i], ctx.needs_input_grad[5 + 2 * i]
            w_grad = None
            if grad is not None and want_w:
                w_grad = _weight_grad(grad, full, params[2 * i], layer.linear_layout, layer.recipe)
            param_grads.append(w_grad)
            param_grads.append(_flat(grad).sum(0) if grad is not None and want_b else None)
        grad_x: torch.Tensor | None = None
        if ctx.needs_input_grad[3]:
            grad_x = _ring_sum(
                ring,
                ring.grad_wire,
                lambda index: _chunk_input_grad(layers, params, grads, grad_full, dim, index * length, length, full),
            )
        return (None, None, None, grad_x, *param_grads)


def _chunk_input_grad(
    layers: Sequence[ColumnMatmul],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    grad_full: torch.Tensor | None,
    dim: int,
    start: int,
    length: int,
    full: torch.Tensor,
) -> torch.Tensor:
    """This rank's share of the input gradient of one sequence chunk: every layer's, plus any direct use of the
    gathered tensor."""
    total = torch.zeros_like(full.narrow(dim, start, length))
    for i, layer in enumerate(layers):
        grad = grads[i]
        if grad is not None:
            g = grad.narrow(dim, start, length)
            total = total + _input_grad(g, params[2 * i], layer.linear_layout, layer.recipe, full.dtype)
    if grad_full is not None:
        total = total + grad_full.narrow(dim, start, length)
    return total


def column_ring(
    x: torch.Tensor,
    dim: int,
    group: ProcessGroup | None,
    layers: Sequence[ColumnMatmul],
    fp8_communication: bool = False,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gathered input and each layer's output over the full sequence, computed as the chunks arrive; with
    `fp8_communication` the chunks travel as fp8 (E4M3) and the input gradient's partial sums as E5M2."""
    if not layers:
        raise ValueError("enable_sequence_overlap: a ring needs at least one column layer")
    params: list[torch.Tensor | None] = []
    for layer in layers:
        params += [layer.weight, layer.bias]
    full, *outs = _ColumnRing.apply(layers, dim, _Ring(group, fp8_communication), x, *params)
    return full, outs


class _RowRing(torch.autograd.Function):
    """Per-chunk matmuls feeding a ring reduce-scatter along the sequence; backward: ring all-gather of the output
    gradient, each arriving chunk's input gradient computed while the next one travels."""

    @staticmethod
    def forward(
        ctx: Any,
        matmul: Callable[[torch.Tensor], torch.Tensor],
        linear_layout: bool,
        recipe: ScalingRecipe | None,
        dim: int,
        ring: _Ring,
        x: torch.Tensor,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        world = ring.world
        if x.shape[dim] % world != 0:
            raise ValueError(
                f"enable_sequence_overlap: dimension {dim} of a tensor of shape {tuple(x.shape)} is not divisible "
                f"by the group size {world}"
            )
        length = x.shape[dim] // world
        out = _ring_sum(ring, ring.forward_wire, lambda index: matmul(x.narrow(dim, index * length, length)))
        ctx.linear_layout, ctx.recipe, ctx.dim, ctx.ring = linear_layout, recipe, dim, ring
        ctx.save_for_backward(x, weight)
        return out.contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, weight = ctx.saved_tensors
        dim, ring, layout, recipe = ctx.dim, ctx.ring, ctx.linear_layout, ctx.recipe
        length = grad.shape[dim]
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[5] else None

        def input_grad(index: int, chunk: torch.Tensor) -> None:
            if grad_x is not None:
                grad_x.narrow(dim, index * length, length).copy_(_input_grad(chunk, weight, layout, recipe, x.dtype))

        grad_full = _ring_gather(ring, ring.grad_wire, dim, grad, input_grad)
        grad_w = _weight_grad(grad_full, x, weight, layout, recipe) if ctx.needs_input_grad[6] else None
        return (None, None, None, None, None, grad_x, grad_w)


def row_ring(
    x: torch.Tensor,
    weight: torch.Tensor,
    matmul: Callable[[torch.Tensor], torch.Tensor],
    linear_layout: bool,
    dim: int,
    group: ProcessGroup | None,
    recipe: ScalingRecipe | None = None,
    fp8_communication: bool = False,
) -> torch.Tensor:
    """`matmul(x)` summed over the group, this rank's sequence chunk kept (split_gather's reduce-scatter), the
    partial sums of each chunk computed while the previous one travels. `recipe`: the use_fp8 recipe `matmul`
    computes with (its backward GEMMs follow it); `fp8_communication`: partial sums travel as E4M3, the output
    gradient's chunks as E5M2."""
    ring = _Ring(group, fp8_communication)
    out: torch.Tensor = _RowRing.apply(matmul, linear_layout, recipe, dim, ring, x, weight)
    return out


def as_column(layer: Any) -> ColumnMatmul:
    """A cx column-parallel layer (`_linear._ColumnBase`) as a ring participant."""
    bias = None if layer.skip_bias_add else layer.bias
    return ColumnMatmul(layer._matmul, layer.weight, bias, layer._out_dim == 0, layer.fp8_recipe)


def weights_present(layers: Sequence[Any]) -> bool:
    """Whether every layer's weight holds its data now. GeminiPlugin gathers a module's parameters only when that
    module runs (an empty storage until then), so a block's hook, which runs first, cannot multiply by them: it
    falls back to the plain gather and the column layers compute as usual (the row layers still ring, inside their
    own forward)."""
    for layer in layers:
        weight = layer.weight
        needed = (weight.storage_offset() + weight.numel()) * weight.element_size()
        if weight.untyped_storage().nbytes() < needed:
            return False
    return True


def stash_outputs(layers: Sequence[nn.Module], gathered: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Hand each column layer the output the block's ring computed for it, to return when it is called on
    `gathered` (`overlapped_output`)."""
    for layer, out in zip(layers, outputs, strict=True):
        setattr(layer, _STASH, (gathered, out))


def clear_stash(layers: Sequence[nn.Module]) -> None:
    """Drop outputs a block's forward did not take (it called a column layer on another tensor)."""
    for layer in layers:
        layer.__dict__.pop(_STASH, None)


def column_overlap_forward(layer: Any, input_: torch.Tensor) -> Any:
    """A column layer's forward under enable_sequence_overlap: the output its block's ring computed for it (the
    policy's hook, `stash_outputs`), or, for a layer that gathers its own input (`seq_parallel_mode='split_gather'`),
    its own ring; (output, bias) with skip_bias_add, as the layer returns. None when the block's hook took the plain
    gather (`weights_present`): the layer then computes as without overlap."""
    check_overlap_layer(layer, "column")
    stashed = layer.__dict__.pop(_STASH, None)
    if stashed is not None and stashed[0] is input_:
        out: torch.Tensor = stashed[1]
    elif layer._split_gather:
        group, fp8 = layer.process_group, layer.fp8_communication
        out = column_ring(input_, layer.seq_parallel_dim, group, [as_column(layer)], fp8)[1][0]
    else:
        return None
    return (out, layer.bias) if layer.skip_bias_add else out


def row_overlap_forward(layer: Any, input_: torch.Tensor) -> Any:
    """A split_gather row layer's forward under enable_sequence_overlap: per-chunk matmuls feeding the ring
    reduce-scatter; the bias is added (or returned with skip_bias_add) after it, as without overlap."""
    check_overlap_layer(layer, "row")
    linear_layout = layer._in_dim == 1
    out = row_ring(
        input_,
        layer.weight,
        layer._matmul,
        linear_layout,
        layer.seq_parallel_dim,
        layer.process_group,
        layer.fp8_recipe,
        layer.fp8_communication,
    )
    if layer.skip_bias_add:
        return out, layer.bias
    return out if layer.bias is None else out + layer.bias


def check_overlap_layer(layer: Any, kind: str) -> None:
    """What a ring cannot compute, refused by name: a use_fp8 recipe outside `RING_RECIPES`, a gathered output, a
    row layer without a split_gather sequence or with an unsplit input."""
    name = type(layer).__name__
    recipe = getattr(layer, "fp8_recipe", None)
    if recipe is not None and recipe not in RING_RECIPES:
        raise ValueError(
            f"enable_sequence_overlap: {name} computes with the fp8 recipe {recipe}, which the overlap ring does not "
            f"implement (it does {', '.join(r.name for r in RING_RECIPES)}); pick one of those or turn the overlap off"
        )
    if kind == "column" and layer.gather_output:
        raise ValueError(f"enable_sequence_overlap: {name} has gather_output=True; the ring keeps the feature shard")
    if kind == "row" and (not layer._split_gather or not layer.parallel_input):
        raise ValueError(
            f"enable_sequence_overlap: {name} needs seq_parallel_mode='split_gather' and parallel_input=True"
        )
