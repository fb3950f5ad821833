"""Which parameters each module's hooks gather: a module's own parameters and its direct children's.

Gathering at module granularity needs a rule for parameters a module reads without calling the module that owns
them: `nn.MultiheadAttention` reads `out_proj.weight` directly, a GPT reads `wte.weight` for its tied LM head. The
rule here: a module's unit is its own parameters plus those of its direct children (looking through containers
that are never called: `nn.ModuleList`, `nn.ModuleDict`). So a module may use its children's parameters directly;
a grandchild's only through the child's forward. Nested units share parameters; the driver counts nested uses.
A unit whose parameters all belong to its parent's unit too (a leaf such as a Linear inside a block) is `covered`:
when its parent is running, its parameters are gathered already and its hooks only record that it ran.
A unit stays gathered while its descendants run: `long_lived_params` names the parameters of units that outlive
more than a chunk's worth of other parameters (a model's root with its embedding and final norm), which the chunk
layout sets apart so they do not keep the chunks of the blocks in between gathered too.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["Unit", "build_units", "long_lived_params", "parameter_names"]

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


def _is_descendant(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "<root>" or name.startswith(ancestor + "."))


def long_lived_params(units: list[Unit], chunk_size: int) -> list[nn.Parameter]:
    """Parameters of every unit whose descendant units hold more than `chunk_size` other elements, in unit order.

    Such a unit keeps its parameters gathered through all of its descendants' forwards and backwards; a chunk it
    shared with one of those descendants would stay gathered just as long."""
    found: dict[int, nn.Parameter] = {}
    for unit in units:
        if unit.covered:
            continue
        own = {id(p) for p in unit.params}
        inner: dict[int, int] = {}
        for other in units:
            if not other.covered and _is_descendant(other.name, unit.name):
                inner.update((id(p), p.numel()) for p in other.params if id(p) not in own)
        if sum(inner.values()) > chunk_size:
            for p in unit.params:
                found.setdefault(id(p), p)
    return list(found.values())
