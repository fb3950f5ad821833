"""Policy selection by model class: the checked policies first, then the generic `base_model_tp_plan` policy."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from cx_shardformer._policy import Policy
from cx_shardformer.policies._gpt2 import GPT2LMHeadModelPolicy, GPT2Policy
from cx_shardformer.policies._llama import LlamaForCausalLMPolicy, LlamaPolicy
from cx_shardformer.policies._tp_plan import TPPlanPolicy

__all__ = ["POLICIES", "get_autopolicy"]

# class name -> policy; names keep transformers an optional, lazily imported dependency
POLICIES: dict[str, Callable[[], Policy]] = {
    "LlamaModel": LlamaPolicy,
    "LlamaForCausalLM": LlamaForCausalLMPolicy,
    "GPT2Model": GPT2Policy,
    "GPT2LMHeadModel": GPT2LMHeadModelPolicy,
}


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
