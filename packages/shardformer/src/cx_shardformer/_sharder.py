"""`ModelSharder`: applies a policy's descriptions to a model (replacements are done in place on the model)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from torch import nn

from cx_shardformer._config import ShardConfig
from cx_shardformer._fp8_switches import apply_fp8
from cx_shardformer._lora import is_lora_wrapper, shard_lora_adapters
from cx_shardformer._policy import ModulePolicyDescription, Policy, SubModuleReplacementDescription

__all__ = ["ModelSharder", "get_submodule_or_none", "set_submodule"]


def get_submodule_or_none(root: nn.Module, path: str) -> nn.Module | None:
    module: nn.Module | None = root
    for part in path.split("."):
        if module is None:
            return None
        module = getattr(module, part, None) if not part.isdigit() else _index(module, int(part))
        if module is not None and not isinstance(module, nn.Module):
            return None
    return module


def _index(module: nn.Module, i: int) -> nn.Module | None:
    if isinstance(module, nn.ModuleList | nn.Sequential) and i < len(module):
        item: nn.Module = module[i]
        return item
    return getattr(module, str(i), None)


def set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = get_submodule_or_none(root, parent_path) if parent_path else root
    if parent is None:
        raise AttributeError(f"no module at {parent_path!r}")
    setattr(parent, name, new)


def _set_attribute(module: nn.Module, path: str, value: Any) -> None:
    target: Any = module
    *parents, name = path.split(".")
    for part in parents:
        target = getattr(target, part)
    setattr(target, name, value)


class ModelSharder:
    """Runs a policy over a model: sanity check, preprocess, replacements per module class, postprocess."""

    def __init__(self, model: nn.Module, policy: Policy, shard_config: ShardConfig) -> None:
        self.model, self.policy, self.shard_config = model, policy, shard_config

    def shard(self) -> list[dict[int, nn.Parameter]]:
        self.policy.set_model(self.model)
        self.policy.set_shard_config(self.shard_config)
        self.policy.config_sanity_check()
        self.model = self.policy.preprocess()
        descriptions = self.policy.module_policy()
        targets = [(name, module) for name, module in self.model.named_modules()]
        for name, module in targets:
            description = descriptions.get(type(module)) or descriptions.get(type(module).__name__)
            if description is not None:
                self._apply(name, module, description)
        self.model = self.policy.postprocess()
        apply_fp8(self.model, self.shard_config)  # use_fp8 / fp8_communication on every TP layer, whatever the policy
        return self.policy.get_shared_params()

    def _apply(self, name: str, module: nn.Module, description: ModulePolicyDescription) -> None:
        for path, value in description.attribute_replacement.items():
            _set_attribute(module, path, value)
        for function in description.param_replacement:
            function(module)
        for replacement in description.sub_module_replacement:
            self._replace(name, module, replacement)
        for method, function in description.method_replacement.items():
            setattr(module, method, types.MethodType(function, module))

    def _replace(self, name: str, module: nn.Module, replacement: SubModuleReplacementDescription) -> None:
        original = get_submodule_or_none(module, replacement.suffix)
        if original is None:
            if replacement.ignore_if_not_exist:
                return
            raise AttributeError(
                f"{type(self.policy).__name__}: {type(module).__name__} at {name or '<root>'!r} has no sub-module "
                f"{replacement.suffix!r} to replace"
            )
        build: Callable[..., object] = getattr(
            replacement.target_module, "from_native_module", replacement.target_module
        )
        group = self.shard_config.tensor_parallel_process_group
        wrapper = original if is_lora_wrapper(original) else None  # LoRA (peft): shard the base, then the adapters
        native = original if wrapper is None else getattr(wrapper, "base_layer")  # noqa: B009  (an nn.Module there)
        new = build(native, process_group=group, **replacement.kwargs)
        if not isinstance(new, nn.Module):
            raise TypeError(f"{replacement.target_module!r} built a {type(new).__name__}, not an nn.Module")
        if wrapper is not None:
            shard_lora_adapters(wrapper, new, group, f"{name}.{replacement.suffix}" if name else replacement.suffix)
            return
        set_submodule(module, replacement.suffix, new)
