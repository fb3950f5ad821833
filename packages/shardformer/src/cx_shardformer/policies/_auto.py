"""Policy selection by model class: the checked policies first, then the generic `base_model_tp_plan` policy."""

from __future__ import annotations

from collections.abc import Callable

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

__all__ = ["POLICIES", "get_autopolicy", "register_policy"]

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


def register_policy(class_name: str, factory: Callable[[], Policy]) -> None:
    """Make `ShardFormer.optimize` pick `factory()` for models of class `class_name`: a package above cx-shardformer
    (cx-plugins' reference GPT, say) registers its policy without cx-shardformer importing it. A name that already
    has a policy raises instead of silently replacing it."""
    if class_name in POLICIES and POLICIES[class_name] is not factory:
        raise ValueError(f"a policy for {class_name} is already registered ({POLICIES[class_name]!r})")
    POLICIES[class_name] = factory


def get_autopolicy(model: nn.Module) -> Policy:
    """The checked policy for `model`'s class, else the generic tp-plan policy when its config has a plan."""
    name = type(model).__name__
    if name in POLICIES:
        return POLICIES[name]()
    config = getattr(model, "config", None)
    if getattr(config, "base_model_tp_plan", None):
        return TPPlanPolicy()
    raise TypeError(
        f"cx-shardformer has no policy for {name}: checked policies cover {sorted(POLICIES)}, and a transformers "
        "model whose config publishes base_model_tp_plan gets the generic one; pass policy=... to ShardFormer.optimize"
    )
