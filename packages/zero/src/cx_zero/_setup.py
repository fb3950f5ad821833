"""Construction-time checks of `LowLevelZeroOptimizer`'s inputs: which parameters it trains, their dtype, their
names and which process group partitions each of them. Every problem is a clear error before any communication.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from cx_mesh import ProcessGroup
from cx_zero._precision import Precision

__all__ = ["decide_working_dtype", "group_params", "parameter_names", "trainable_params"]


def trainable_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters that require a gradient, in param-group order (each at most once)."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError("a parameter appears twice in the optimizer's param groups")
            seen.add(id(param))
            if param.requires_grad:
                params.append(param)
    if not params:
        raise ValueError("the optimizer has no parameter that requires a gradient")
    return params


def decide_working_dtype(params: list[nn.Parameter], forced_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the model computes in: `forced_dtype` (casting the parameters) or the parameters' common dtype."""
    if forced_dtype is not None:
        for param in params:
            if param.dtype != forced_dtype:
                param.data = param.data.to(forced_dtype)
        return forced_dtype
    dtypes = sorted({str(p.dtype) for p in params})
    if len(dtypes) > 1:
        raise ValueError(f"parameters have mixed dtypes {dtypes}: cast the model or pass forced_dtype")
    return Precision.parse(params[0].dtype, what="parameter dtype").dtype


def parameter_names(
    params: list[nn.Parameter], module: nn.Module | Mapping[str, torch.Tensor] | None
) -> dict[int, str]:
    """id(param) -> state-dict key: its name in `module` (first name for tied weights) or its position."""
    if module is None:
        return {id(p): str(i) for i, p in enumerate(params)}
    pairs = module.named_parameters() if isinstance(module, nn.Module) else module.items()
    by_id: dict[int, str] = {}
    for name, tensor in pairs:
        by_id.setdefault(id(tensor), name)
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"optimizer parameters at positions {missing} are not in the given module / name map")
    return {id(p): by_id[id(p)] for p in params}


def group_params(
    params: list[nn.Parameter],
    pg_to_param_list: Mapping[ProcessGroup, list[nn.Parameter]] | None,
    dp_process_group: ProcessGroup | None,
) -> list[tuple[ProcessGroup | None, list[nn.Parameter]]]:
    """(group, its parameters in optimizer order) for each group; every trainable parameter in exactly one."""
    if pg_to_param_list is None:
        return [(dp_process_group, params)]
    in_optimizer = {id(p): i for i, p in enumerate(params)}
    owner: dict[int, int] = {}
    result: list[tuple[ProcessGroup | None, list[nn.Parameter]]] = []
    for index, (group, group_params) in enumerate(pg_to_param_list.items()):
        chosen = []
        for param in group_params:
            if not param.requires_grad:
                continue
            if id(param) not in in_optimizer:
                raise ValueError(f"pg_to_param_list entry {index} holds a parameter the optimizer does not")
            if id(param) in owner:
                raise ValueError(f"a parameter is listed under two process groups ({owner[id(param)]} and {index})")
            owner[id(param)] = index
            chosen.append(param)
        result.append((group, sorted(chosen, key=lambda p: in_optimizer[id(p)])))
    orphans = [i for i, p in enumerate(params) if id(p) not in owner]
    if orphans:
        raise ValueError(f"optimizer parameters at positions {orphans} are in no pg_to_param_list group")
    return result
