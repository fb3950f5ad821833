"""Checked policy for transformers' Llama (grouped-query attention, RMSNorm, rotary embeddings, untied head).

q/k/v, gate and up projections are column-parallel, o and down row-parallel; key/value heads are split as whole
heads, so both `num_attention_heads` and `num_key_value_heads` must divide by tp. transformers 5's Llama attention
reshapes with -1 heads, so no per-rank head count needs rewriting.
"""

from __future__ import annotations

from torch import nn

from cx_shardformer._linear import Linear1D_Col, Linear1D_Row
from cx_shardformer._policy import ModulePolicyDescription, SubModuleReplacementDescription
from cx_shardformer.policies._common import HFDecoderPolicy, check_divisible
from cx_shardformer.policies._sequence import apply_sequence_parallelism, check_sequence_parallelism

__all__ = ["LlamaForCausalLMPolicy", "LlamaPolicy"]


class LlamaPolicy(HFDecoderPolicy):
    """`LlamaModel` (and the base of `LlamaForCausalLM`)."""

    embedding_path = "embed_tokens"
    layers_path = "layers"
    norm_path = "norm"
    decoder_layer = "LlamaDecoderLayer"

    def config_sanity_check(self) -> None:
        config = self.hf_config
        self.reject_expert_parallelism()
        if self.shard_config.enable_tensor_parallelism:
            check_divisible(self.model, "num_attention_heads", config.num_attention_heads, self.tp_size)
            check_divisible(self.model, "num_key_value_heads", config.num_key_value_heads, self.tp_size)
            check_divisible(self.model, "intermediate_size", config.intermediate_size, self.tp_size)
        check_sequence_parallelism(self)

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        split_gather = self.shard_config.sequence_parallelism_mode == "split_gather"
        row = {"seq_parallel_mode": "split_gather"} if split_gather else {}
        subs = [
            SubModuleReplacementDescription("self_attn.q_proj", Linear1D_Col),
            SubModuleReplacementDescription("self_attn.k_proj", Linear1D_Col),
            SubModuleReplacementDescription("self_attn.v_proj", Linear1D_Col),
            SubModuleReplacementDescription("self_attn.o_proj", Linear1D_Row, kwargs=row),
            SubModuleReplacementDescription("mlp.gate_proj", Linear1D_Col),
            SubModuleReplacementDescription("mlp.up_proj", Linear1D_Col),
            SubModuleReplacementDescription("mlp.down_proj", Linear1D_Row, kwargs=row),
        ]
        return {self.decoder_layer: ModulePolicyDescription(sub_module_replacement=subs)}

    def postprocess(self) -> nn.Module:
        if self.shard_config.enable_tensor_parallelism:
            self.shard_vocab()
        apply_sequence_parallelism(self)
        self.share_input_reduction()
        self.apply_switches()
        return self.model


class LlamaForCausalLMPolicy(LlamaPolicy):
    """`LlamaForCausalLM`: the base model under `model.`, plus the vocabulary-parallel LM head and loss."""

    embedding_path = "model.embed_tokens"
    layers_path = "model.layers"
    norm_path = "model.norm"
