"""The `Policy` interface (ColossalAI's): how one model family is sharded.

A policy names, per module class, the sub-modules to replace (`SubModuleReplacementDescription`: a suffix and a
layer class with `from_native_module`), the attributes to set (per-rank head counts) and methods to replace, plus
`preprocess` / `postprocess` steps for what is not a replacement (hooks, loss functions). An MoE policy plugs in the
same way: its description replaces an MoE block (`suffix="mlp"`) with an expert-parallel layer whose
`from_native_module(module, process_group=..., ep_group=..., moe_dp_group=...)` receives the groups through `kwargs`
(the ShardConfig carries `ep_group` and `moe_dp_group`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import nn

from cx_shardformer._config import ShardConfig

__all__ = ["ModulePolicyDescription", "NativeReplaceable", "Policy", "SubModuleReplacementDescription"]


class NativeReplaceable(Protocol):
    """A layer class that can be built from the module it replaces."""

    @classmethod
    def from_native_module(cls, module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module: ...


@dataclass(frozen=True)
class SubModuleReplacementDescription:
    """Replace the sub-module at `suffix` (dotted, relative to the policy's module) by
    `target_module.from_native_module(module, process_group=<tp group>, **kwargs)`."""

    suffix: str
    target_module: type[NativeReplaceable] | Callable[..., nn.Module]
    kwargs: dict[str, Any] = field(default_factory=dict)
    ignore_if_not_exist: bool = False


@dataclass(frozen=True)
class ModulePolicyDescription:
    """What to do to every module of one class: attributes to set (dotted names allowed), functions called with the
    module (`param_replacement`), sub-modules to replace, and methods to replace (bound to the module)."""

    attribute_replacement: dict[str, Any] = field(default_factory=dict)
    param_replacement: list[Callable[[nn.Module], None]] = field(default_factory=list)
    sub_module_replacement: list[SubModuleReplacementDescription] = field(default_factory=list)
    method_replacement: dict[str, Callable[..., Any]] = field(default_factory=dict)


class Policy:
    """Base policy. Subclasses implement `module_policy` and may override the other steps.

    Keys of `module_policy()` are module classes or class names (names let a policy avoid importing transformers).
    """

    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._shard_config: ShardConfig | None = None

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__}: set_model was not called")
        return self._model

    @property
    def shard_config(self) -> ShardConfig:
        if self._shard_config is None:
            raise RuntimeError(f"{type(self).__name__}: set_shard_config was not called")
        return self._shard_config

    def set_model(self, model: nn.Module) -> None:
        self._model = model

    def set_shard_config(self, shard_config: ShardConfig) -> None:
        self._shard_config = shard_config

    def config_sanity_check(self) -> None:
        """Raise a clear error for a model/config this policy cannot shard (before anything is changed)."""

    def preprocess(self) -> nn.Module:
        """Changes before the replacements (default: none)."""
        return self.model

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        """Per module class, what to replace."""
        raise NotImplementedError(f"{type(self).__name__} must implement module_policy()")

    def postprocess(self) -> nn.Module:
        """Changes after the replacements (default: none)."""
        return self.model

    def get_held_layers(self) -> list[nn.Module]:
        """The layers this rank holds (every layer: no pipeline stages here)."""
        return [self.model]

    def get_shared_params(self) -> list[dict[int, nn.Parameter]]:
        """Parameters shared between pipeline stages (none without pipeline parallelism)."""
        return []
