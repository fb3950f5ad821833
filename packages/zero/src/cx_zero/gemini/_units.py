"""Which parameters each module's hooks gather: a module's own parameters and its direct children's.

Gathering at module granularity needs a rule for parameters a module reads without calling the module that owns
them: `nn.MultiheadAttention` reads `out_proj.weight` directly, a GPT reads `wte.weight` for its tied LM head. The
rule here: a module's unit is its own parameters plus those of its direct children (looking through containers
that are never called: `nn.ModuleList`, `nn.ModuleDict`). So a module may use its children's parameters directly;
a grandchild's only through the child's forward. Nested units share parameters; the driver counts nested uses.
A unit whose parameters all belong to its parent's unit too (a leaf such as a Linear inside a block) is `covered`:
when its parent is running, its parameters are gathered already and its hooks only record that it ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Unit", "build_units", "parameter_names"]

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


@dataclass(frozen=True)
class Unit:
    """The parameters gathered around one module's forward and backward."""

    name: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    direct: tuple[nn.Parameter, ...]  # the module's own parameters: certainly used when its forward runs
    covered: bool = False  # every parameter is also in the parent module's unit (usually gathered already)


def _direct(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def _children_params(module: nn.Module) -> list[nn.Parameter]:
    found: list[nn.Parameter] = []
    for child in module.children():
        found.extend(_direct(child))
        if isinstance(child, _CONTAINERS):
            found.extend(_children_params(child))
    return found


def build_units(root: nn.Module) -> list[Unit]:
    """One unit per called module that has parameters in its unit, in `named_modules` order."""
    units: list[Unit] = []
    for name, module in root.named_modules(remove_duplicate=True):
        if isinstance(module, _CONTAINERS) and module is not root:
            continue
        seen: set[int] = set()
        params: list[nn.Parameter] = []
        for p in [*_direct(module), *_children_params(module)]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        if params:
            units.append(Unit(name or "<root>", module, tuple(params), tuple(_direct(module))))
    by_name = {unit.name: unit for unit in units}
    for index, unit in enumerate(units):
        parent = by_name.get(unit.name.rpartition(".")[0] or "<root>") if unit.name != "<root>" else None
        if parent is not None and {id(p) for p in unit.params} <= {id(p) for p in parent.params}:
            units[index] = Unit(unit.name, unit.module, unit.params, unit.direct, covered=True)
    return units


def parameter_names(root: nn.Module) -> dict[int, list[str]]:
    """Every name of every parameter (a tied parameter has several), by parameter id, in module order."""
    names: dict[int, list[str]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names
