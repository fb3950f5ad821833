"""Policies: checked ones for transformers' Llama, GPT-2 and MoE decoders (Mixtral, Qwen3-MoE, DeepSeek-V3), the
generic `base_model_tp_plan` one, and selection by model class."""

from cx_shardformer.policies._auto import POLICIES, NoPolicyError, get_autopolicy, register_policy
from cx_shardformer.policies._common import HFDecoderPolicy, VocabParallelCausalLMLoss
from cx_shardformer.policies._gpt2 import GPT2LMHeadModelPolicy, GPT2Policy
from cx_shardformer.policies._llama import LlamaForCausalLMPolicy, LlamaPolicy
from cx_shardformer.policies._moe import (
    DeepseekV3ForCausalLMPolicy,
    DeepseekV3Policy,
    MixtralForCausalLMPolicy,
    MixtralPolicy,
    MoEDecoderPolicy,
    Qwen2MoeForCausalLMPolicy,
    Qwen2MoePolicy,
    Qwen3MoeForCausalLMPolicy,
    Qwen3MoePolicy,
)
from cx_shardformer.policies._tp_plan import TPPlanPolicy

__all__ = [
    "POLICIES",
    "NoPolicyError",
    "DeepseekV3ForCausalLMPolicy",
    "DeepseekV3Policy",
    "MixtralForCausalLMPolicy",
    "MixtralPolicy",
    "MoEDecoderPolicy",
    "Qwen2MoeForCausalLMPolicy",
    "Qwen2MoePolicy",
    "Qwen3MoeForCausalLMPolicy",
    "Qwen3MoePolicy",
    "GPT2LMHeadModelPolicy",
    "GPT2Policy",
    "HFDecoderPolicy",
    "LlamaForCausalLMPolicy",
    "LlamaPolicy",
    "TPPlanPolicy",
    "VocabParallelCausalLMLoss",
    "get_autopolicy",
    "register_policy",
]
