"""GeminiDDP state dicts: full tensors out chunk by chunk, full tensors in with each rank keeping its own part.

Saving streams: one chunk is all-gathered at a time (its fp32 master when there is one, so nothing is lost to the
low-precision copy), its tensors are cast back to the parameter's original dtype, and a piece is emitted whenever
`max_shard_size` bytes have accumulated, so no rank ever holds the whole model. Tied parameters are stored once in
the chunks and emitted under every name they have. Loading writes each rank's flat range of every tensor into the
parameter chunk (and the master chunk); chunks kept gathered take the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist

from cx_checkpoint import TensorSpec
from cx_chunk import Chunk
from cx_zero.gemini._chunked_model import ChunkedModel

__all__ = ["expected", "is_saver", "load_full", "state_dict_shard", "write_own_slices", "write_parameter"]


def is_saver(ddp: ChunkedModel) -> bool:
    """Rank 0 of the zero group (and of the extra data-parallel group) holds what is saved."""
    groups = [ddp.zero_group] + ([ddp.extra_dp_group] if ddp.extra_dp_group is not None else [])
    return all(dist.get_rank(g) == 0 for g in groups)


def _buffers(ddp: ChunkedModel) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for module_name, module in ddp.module.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{module_name}.{name}" if module_name else name] = buf
    return out


def state_dict_shard(
    ddp: ChunkedModel, prefix: str, max_shard_size: int, only_rank_0: bool
) -> Iterator[tuple[dict[str, torch.Tensor], int]]:
    """Pieces of (tensors, bytes); max_shard_size <= 0 means one piece. Collective over the zero group."""
    keep = is_saver(ddp) or not only_rank_0
    piece: dict[str, torch.Tensor] = {}
    size = 0
    for param, value in ddp._named_full_tensors():
        if not keep:
            continue
        for number, name in enumerate(ddp.all_param_names[id(param)]):
            piece[prefix + name] = value if number == 0 else value.clone()  # writers refuse shared storage
        size += value.numel() * value.element_size()
        if 0 < max_shard_size <= size:
            yield piece, size
            piece, size = {}, 0
    if keep:
        for name, buf in _buffers(ddp).items():
            piece[prefix + name] = buf.detach().to("cpu", ddp.buffer_dtypes.get(id(buf), buf.dtype), copy=True)
            size += buf.numel() * buf.element_size()
        if piece:
            yield piece, size


def expected(ddp: ChunkedModel) -> dict[str, TensorSpec]:
    """Every name this model loads: all names of every parameter (full shape, original dtype) and its buffers."""
    out: dict[str, TensorSpec] = {}
    for chunk in ddp.manager.chunks():
        for tensor, slot in zip(chunk.tensors, chunk.slots, strict=True):
            for name in ddp.all_param_names[id(tensor)]:
                out[name] = TensorSpec(tuple(slot.shape), ddp.original_dtypes[id(tensor)])
    for name, buf in _buffers(ddp).items():
        out[name] = TensorSpec(tuple(buf.shape), ddp.buffer_dtypes.get(id(buf), buf.dtype))
    return out


def load_full(ddp: ChunkedModel, state_dict: Mapping[str, torch.Tensor], strict: bool) -> tuple[list[str], list[str]]:
    """Write full tensors into this rank's chunk parts; returns (missing, unexpected) names."""
    known: set[str] = set()
    missing: list[str] = []
    values: dict[int, torch.Tensor] = {}
    for chunk in ddp.manager.chunks():
        for tensor, slot in zip(chunk.tensors, chunk.slots, strict=True):
            names = ddp.all_param_names[id(tensor)]
            known.update(names)
            present = [n for n in names if n in state_dict]
            if not present:
                missing.extend(names)
                continue
            value = state_dict[present[0]]
            if tuple(value.shape) != tuple(slot.shape):
                raise ValueError(
                    f"GeminiDDP.load_state_dict: {present[0]!r} has shape {list(value.shape)}, the model's parameter "
                    f"has {list(slot.shape)}"
                )
            values[id(tensor)] = value
    buffers = _buffers(ddp)
    known.update(buffers)
    missing.extend(name for name in buffers if name not in state_dict)
    unexpected = [name for name in state_dict if name not in known]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"GeminiDDP.load_state_dict: missing keys {missing}, unexpected keys {unexpected} (strict=True)"
        )
    for name, buf in buffers.items():
        if name in state_dict:
            buf.copy_(state_dict[name].to(buf.device, buf.dtype))
    for chunk in ddp.manager.chunks():
        _write_chunk(ddp, chunk, values)
    return missing, unexpected


def write_parameter(ddp: ChunkedModel, param: torch.Tensor, value: torch.Tensor) -> None:
    """Write one full parameter value into this rank's part of its chunk (and master chunk)."""
    _write_chunk(ddp, ddp.manager.get_chunk(param), {id(param): value})


def _write_chunk(ddp: ChunkedModel, chunk: Chunk, values: Mapping[int, torch.Tensor]) -> None:
    if chunk.is_gathered:
        for tensor in chunk.tensors:
            if id(tensor) in values:
                chunk.write(tensor, values[id(tensor)].to(chunk.dtype))
    elif chunk.has_own_slice:  # otherwise the master below is where the values live
        write_own_slices(chunk, chunk, values)
    if chunk.paired is not None:
        write_own_slices(ddp.manager.master_chunk(chunk), chunk, values)


def write_own_slices(target: Chunk, layout: Chunk, values: Mapping[int, torch.Tensor]) -> None:
    """Write this rank's flat range of each full tensor in `values` (keyed by id of `layout`'s tensors) into
    `target`'s own slice; `target` is `layout` itself or a chunk laid out like it (its master)."""
    shard = target.shard_tensor()
    by_name = {slot.name: tensor for tensor, slot in zip(layout.tensors, layout.slots, strict=True)}
    for view in target.shard_views():
        tensor = by_name[view.name]
        if id(tensor) in values:
            flat = values[id(tensor)].reshape(-1)[view.tensor_begin : view.tensor_end]
            shard[view.shard_begin : view.shard_end].copy_(flat.to(shard.device, shard.dtype))
