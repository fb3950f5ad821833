"""Shard a module with FSDP2 the way an FSDP1 auto-wrap policy would have wrapped it, and keep an optimizer built
before sharding pointing at the sharded parameters.

FSDP1 policies (`ModuleWrapPolicy`, `functools.partial(transformer_auto_wrap_policy, ...)`, size-based ones) are
callables `policy(module, recurse, nonwrapped_numel)`. Walking the tree bottom-up, a submodule gets its own
`fully_shard` when the policy says so for the parameters not already inside a sharded descendant, as FSDP1's
recursive wrapping decides; the root is always sharded last, taking what is left. With `use_fp8` the eligible
linears become fp8 linears first; with `fp8_communication` every sharded module gets the fp8 collectives, else on
gloo collectives that free their buffers at fixed points (`_gloo_comms`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim import Optimizer

from cx_mesh import get_accelerator
from cx_plugins.fsdp._fp8 import convert_linears, use_fp8_collectives
from cx_plugins.fsdp._gloo_comms import InPlaceReduceScatter, ReleasedAllGather
from cx_plugins.fsdp._options import FSDPOptions

__all__ = ["cast_buffers", "repoint_optimizer", "shard_module", "sync_module_states"]


def _post_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _numel(module: nn.Module, claimed: set[nn.Parameter]) -> int:
    return sum(p.numel() for p in module.parameters() if p not in claimed)


def _mesh(group: dist.ProcessGroup | None) -> DeviceMesh:
    group = group if group is not None else dist.group.WORLD
    assert group is not None, "torch.distributed is initialised before the plugin is built"
    return DeviceMesh.from_group(group, get_accelerator().name)


def shard_module(module: nn.Module, options: FSDPOptions) -> list[nn.Module]:
    """Apply `fully_shard` to the submodules the wrap policy picks, then to `module`; returns them, root last."""
    if options.fp8_linears is not None:  # use_fp8: the linears are swapped before fully_shard wraps them
        convert_linears(module, options.fp8_linears, options.fp8_communication, options.fp8_recipe)
    ignored = {p for m in options.ignored_modules for p in m.parameters()}
    claimed = set(ignored)
    chosen: list[nn.Module] = []
    policy: Callable[..., bool] | None = options.wrap_policy
    if policy is not None:
        for candidate in _post_order(module):
            if candidate is module or candidate in options.ignored_modules:
                continue
            remaining = _numel(candidate, claimed)
            if remaining > 0 and policy(module=candidate, recurse=False, nonwrapped_numel=remaining):
                chosen.append(candidate)
                claimed.update(candidate.parameters())
    mesh = _mesh(options.process_group)
    for target in [*chosen, module]:
        fully_shard(
            target,
            mesh=mesh,
            reshard_after_forward=options.reshard_after_forward,
            mp_policy=options.mp_policy,
            offload_policy=options.offload_policy,
            ignored_params=ignored or None,
        )
    if options.fp8_communication:
        use_fp8_collectives([*chosen, module])
    elif dist.get_backend(mesh.get_group()) == "gloo":  # buffers freed where FSDP2 drops them (_gloo_comms)
        for target in [*chosen, module]:
            assert isinstance(target, FSDPModule), "fully_shard returns its module as an FSDPModule"
            target.set_custom_all_gather(ReleasedAllGather())
            target.set_custom_reduce_scatter(InPlaceReduceScatter())
    return [*chosen, module]


def sync_module_states(module: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Give every rank rank 0's parameters and buffers (FSDP1's `sync_module_states=True`), before sharding."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, source, group=group)


def cast_buffers(module: nn.Module, dtype: torch.dtype | None) -> None:
    """FSDP1's `MixedPrecision(buffer_dtype=...)`: floating buffers held in that dtype."""
    if dtype is None:
        return
    for owner in module.modules():
        for name, buffer in owner.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point():
                owner._buffers[name] = buffer.to(dtype)


def repoint_optimizer(optimizer: Optimizer, before: dict[nn.Parameter, str], module: nn.Module) -> None:
    """Swap each parameter of `optimizer` (taken before sharding) for the sharded parameter of the same name, keeping
    the param groups and their hyper-parameters (ColossalAI re-initialises the optimizer and loses its groups), and
    record the names (`param_names`) that checkpoints key optimizer state by."""
    after = dict(module.named_parameters())
    if any(optimizer.state.values()):
        raise ValueError("TorchFSDPPlugin: boost the optimizer before its first step (it already holds state)")
    for number, group in enumerate(optimizer.param_groups):
        names = []
        for parameter in group["params"]:
            name = before.get(parameter)
            if name is None or name not in after:
                raise ValueError(
                    f"TorchFSDPPlugin: optimizer param group {number} holds a tensor that is not a parameter of the "
                    "boosted model"
                )
            names.append(name)
        group["params"] = [after[name] for name in names]
        group["param_names"] = names
