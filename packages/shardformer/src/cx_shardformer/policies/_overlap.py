"""enable_sequence_overlap in the Hugging Face decoder policies: each split_gather block's sequence all-gather becomes
one ring (`cx_shardformer._overlap`) that feeds every column layer of the block as the chunks arrive, and its row
layer reduce-scatters through the ring too.

A block qualifies when its column layers all read the block input (the policy's `shares_block_reductions`, which
the checked policies verify for their model); use_fp8 and fp8_communication run inside the ring. An explicit
enable_sequence_overlap on a block that does not qualify raises; when enable_all_optimization switched it on, such a
block keeps the plain gather and a warning says so once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_shardformer._linear import _ColumnBase, _RowBase, mark_input_grad_reduced
from cx_shardformer._overlap import (
    as_column,
    check_overlap_layer,
    clear_stash,
    column_ring,
    stash_outputs,
    weights_present,
)
from cx_shardformer.policies._decoder import DecoderPolicy

__all__ = ["block_gather_hook"]

_Hook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[Any, dict[str, Any]]]


def _ring_hook(columns: list[_ColumnBase], group: ProcessGroup | None, gather: _Hook) -> _Hook:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not weights_present(columns):  # GeminiPlugin: gathered when each layer runs
            return gather(module, args, kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor):
            raise TypeError("enable_sequence_overlap: the block received no hidden_states tensor")
        fp8 = columns[0].fp8_communication  # set after sharding (apply_fp8), the same on every layer: read it now
        full, outs = column_ring(hidden, 1, group, [as_column(column) for column in columns], fp8)
        mark_input_grad_reduced(full, group)  # the ring's backward reduce-scatters its input gradient
        stash_outputs(columns, full, outs)
        if args:
            return (full, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": full}

    return hook


def _refusal(policy: DecoderPolicy, block: nn.Module, columns: list[_ColumnBase], rows: list[_RowBase]) -> str | None:
    """Why `block` cannot run the ring, or None."""
    if not policy.shares_block_reductions:
        return (
            f"{type(policy).__name__} cannot verify that every column layer of {type(block).__name__} reads the block "
            "input (the generic policy); write a Policy for this model"
        )
    if not columns:
        return f"{type(block).__name__} has no column-parallel layer to overlap the gather with"
    try:
        for column in columns:
            check_overlap_layer(column, "column")
        for row in rows:
            check_overlap_layer(row, "row")
    except ValueError as error:
        return str(error)
    return None


def block_gather_hook(policy: DecoderPolicy, block: nn.Module, gather: _Hook) -> _Hook:
    """The forward pre-hook that brings `block` the full sequence: `gather` (split_gather's all-gather), or, with
    enable_sequence_overlap, the ring that also computes the block's column layers, its row layers switched to the
    ring reduce-scatter."""
    config = policy.shard_config
    if not config.enable_sequence_overlap:
        return gather
    group = config.tensor_parallel_process_group
    columns = [m for m in block.modules() if isinstance(m, _ColumnBase) and m.process_group is group]
    rows = [m for m in block.modules() if isinstance(m, _RowBase) and m._split_gather]
    reason = _refusal(policy, block, columns, rows)
    if reason is not None:
        if not config.enable_all_optimization:
            raise ValueError(f"enable_sequence_overlap: {reason}")
        warnings.warn(f"enable_all_optimization: sequence overlap left off here: {reason}", UserWarning, stacklevel=2)
        return gather
    for column in columns:
        column.sequence_overlap = True
    for row in rows:
        row.sequence_overlap = True
    block.register_forward_hook(lambda module, args, output: clear_stash(columns), always_call=True)
    return _ring_hook(columns, group, gather)
