"""Tensor parallelism through LoRA wrappers (Hugging Face peft's `LoraLayer`: `base_layer` + `lora_A` + `lora_B`).

A policy names `q_proj`; under peft that module is a wrapper whose `base_layer` is the `nn.Linear`. The sharder shards
the base layer as the policy says and shards the adapters to match, so the wrapper's own forward
(`base_layer(x) + lora_B(lora_A(x)) * scaling`) computes this rank's part:

- column-parallel base (output features split): `lora_B` becomes a column-parallel layer (its output rows split like
  the base's). The layer's input gradient is summed over the group once for both branches (by the block's reduction
  when the policy marked the input, `mark_input_grad_reduced`, else by the wrapper's own `copy_to_parallel`), so
  `lora_A` (replicated) passes on a partial input gradient and its own weight gradient is summed over the group
  (`sync_grad_over`);
- row-parallel base (input features split): `lora_A` becomes a row-parallel layer (its input columns split, its
  rank-sized partial output all-reduced); `lora_B`, replicated, adds to the base's all-reduced output.

Duck-typed: cx-shardformer does not import peft. Sequence parallelism, DoRA, lora_dropout > 0, adapters on
embeddings and fused layers are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_shardformer._comm import copy_to_parallel
from cx_shardformer._linear import _REDUCED, Linear1D_Col, Linear1D_Row, mark_input_grad_reduced, sync_grad_over

__all__ = ["is_lora_wrapper", "shard_lora_adapters"]


def is_lora_wrapper(module: nn.Module) -> bool:
    """A peft LoRA layer: a `base_layer` module and `lora_A` / `lora_B` module dicts."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def _refuse_extras(wrapper: nn.Module, where: str) -> None:
    dora = getattr(wrapper, "use_dora", {})
    if any(bool(v) for v in (dora.values() if isinstance(dora, dict) else [dora])):
        raise NotImplementedError(
            f"{where}: DoRA adapters under tensor parallelism are not supported; use plain LoRA (use_dora=False) or "
            "tp_size=1"
        )
    dropout = getattr(wrapper, "lora_dropout", None)
    if isinstance(dropout, nn.ModuleDict) and any(isinstance(d, nn.Dropout) and d.p > 0 for d in dropout.values()):
        raise NotImplementedError(
            f"{where}: lora_dropout > 0 under tensor parallelism is not supported (the tp ranks would drop different "
            "inputs of the same adapter); use lora_dropout=0.0"
        )
    for extra in ("lora_embedding_A", "lora_magnitude_vector"):
        container = getattr(wrapper, extra, None)
        if isinstance(container, nn.ParameterDict | nn.ModuleDict) and len(container) > 0:
            raise NotImplementedError(
                f"{where}: LoRA {extra} under tensor parallelism is not supported; leave that layer out of the "
                "adapters' target_modules, or use tp_size=1"
            )


def shard_lora_adapters(wrapper: nn.Module, base: nn.Module, group: ProcessGroup | None, where: str) -> None:
    """Put the sharded `base` in `wrapper` and shard its adapters to match (module docs); `where` names the layer."""
    _refuse_extras(wrapper, where)
    if getattr(base, "seq_parallel_mode", None) is not None or getattr(base, "skip_bias_add", False):
        which = "sequence parallelism" if getattr(base, "seq_parallel_mode", None) is not None else "skip_bias_add"
        raise NotImplementedError(
            f"{where}: LoRA adapters on a layer with {which} are not supported; turn {which} off, or leave this "
            "layer out of the adapters' target_modules"
        )
    lora_a, lora_b = wrapper.lora_A, wrapper.lora_B
    if not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        raise TypeError(f"{where}: lora_A / lora_B are not module dicts (an unknown peft layer)")
    if type(base) is Linear1D_Col:
        for name in list(lora_b.keys()):
            lora_b[name] = Linear1D_Col.from_native_module(lora_b[name], group, gather_output=base.gather_output)
            replicated = lora_a[name]
            if not isinstance(replicated, nn.Linear) or not isinstance(replicated.weight, nn.Parameter):
                raise TypeError(f"{where}: lora_A[{name!r}] is a {type(replicated).__name__}, not an nn.Linear")
            sync_grad_over(replicated.weight, group)
            replicated.register_forward_hook(_reduced_output(group))
        wrapper.register_forward_pre_hook(_reduced_input(group))
    elif type(base) is Linear1D_Row:
        for name in list(lora_a.keys()):
            lora_a[name] = Linear1D_Row.from_native_module(lora_a[name], group, parallel_input=base.parallel_input)
    else:
        raise NotImplementedError(
            f"{where}: LoRA adapters on a {type(base).__name__} are not supported under tensor parallelism (only "
            "Linear1D_Col and Linear1D_Row bases: target unfused linear layers)"
        )
    wrapper.base_layer = base


def _reduced_input(group: ProcessGroup | None) -> Any:
    """A column LoRA layer's input with its gradient summed over `group` once, for the base and the adapters."""

    def hook(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if not hasattr(x, _REDUCED) or getattr(x, _REDUCED) is not group:  # as the column layers read the mark
            x = copy_to_parallel(x, group, False)
            mark_input_grad_reduced(x, group)
        return (x, *args[1:])

    return hook


def _reduced_output(group: ProcessGroup | None) -> Any:
    """lora_A's output goes to the column-parallel lora_B as it is: its partial gradient flows back to the layer's
    input, which the column layer sums once (and lora_A's weight gradient is summed by `sync_grad_over`)."""

    def hook(_module: nn.Module, _args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            mark_input_grad_reduced(output, group)

    return hook
