"""Policy selection by model class: the checked policies first, then the generic `base_model_tp_plan` policy."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from cx_shardformer._policy import Policy
from cx_shardformer.policies._gpt2 import GPT2LMHeadModelPolicy, GPT2Policy
from cx_shardformer.policies._llama import LlamaForCausalLMPolicy, LlamaPolicy
from cx_shardformer.policies._moe import (
    DeepseekV3ForCausalLMPolicy,
    DeepseekV3Policy,
    MixtralForCausalLMPolicy,
    MixtralPolicy,
    Qwen2MoeForCausalLMPolicy,
    Qwen2MoePolicy,
    Qwen3MoeForCausalLMPolicy,
    Qwen3MoePolicy,
)
from cx_shardformer.policies._tp_plan import TPPlanPolicy

__all__ = ["POLICIES", "NoPolicyError", "get_autopolicy", "register_policy"]

# class name -> policy; names keep transformers an optional, lazily imported dependency
POLICIES: dict[str, Callable[[], Policy]] = {
    "LlamaModel": LlamaPolicy,
    "LlamaForCausalLM": LlamaForCausalLMPolicy,
    "GPT2Model": GPT2Policy,
    "GPT2LMHeadModel": GPT2LMHeadModelPolicy,
    "MixtralModel": MixtralPolicy,
    "MixtralForCausalLM": MixtralForCausalLMPolicy,
    "Qwen2MoeModel": Qwen2MoePolicy,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLMPolicy,
    "Qwen3MoeModel": Qwen3MoePolicy,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLMPolicy,
    "DeepseekV3Model": DeepseekV3Policy,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLMPolicy,
}


class NoPolicyError(TypeError):
    """No policy for a model's class and no `base_model_tp_plan` to fall back on. `remedy` says what the caller can
    pass: ShardFormer.optimize's `policy=`, or a plugin's `custom_policy=` (the plugins re-raise with theirs)."""

    def __init__(
        self, model_class: str, known: Sequence[str], remedy: str = "pass policy=... to ShardFormer.optimize"
    ) -> None:
        super().__init__(model_class, tuple(known), remedy)  # args rebuild it when pickled across ranks
        self.model_class = model_class
        self.known = tuple(known)
        self.remedy = remedy

    def __str__(self) -> str:
        return (
            f"cx-shardformer has no policy for {self.model_class}: checked policies cover {sorted(self.known)}, and "
            f"a transformers model whose config publishes base_model_tp_plan gets the generic one; {self.remedy}"
        )


def register_policy(class_name: str, factory: Callable[[], Policy]) -> None:
    """Make `ShardFormer.optimize` pick `factory()` for models of class `class_name`: a package above cx-shardformer
    (cx-plugins' reference GPT, say) registers its policy without cx-shardformer importing it. A name that already
    has a policy raises instead of silently replacing it."""
    if class_name in POLICIES and POLICIES[class_name] is not factory:
        raise ValueError(f"a policy for {class_name} is already registered ({POLICIES[class_name]!r})")
    POLICIES[class_name] = factory


def get_autopolicy(model: nn.Module) -> Policy:
    """The checked policy for `model`'s class, else the generic tp-plan policy when its config has a plan, else
    `NoPolicyError`."""
    name = type(model).__name__
    if name in POLICIES:
        return POLICIES[name]()
    config = getattr(model, "config", None)
    if getattr(config, "base_model_tp_plan", None):
        return TPPlanPolicy()
    raise NoPolicyError(name, list(POLICIES))
