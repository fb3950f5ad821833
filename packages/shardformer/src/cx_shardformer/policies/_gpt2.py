"""Checked policy for transformers' GPT-2: `Conv1D` weights ([in, out]), the fused `c_attn` (q, k, v split
separately), learned position embeddings (replicated) and the LM head tied to the token embedding (sharded once).

GPT-2's attention splits `c_attn`'s output by `split_size` and reshapes with -1 heads: `split_size`, `num_heads`
and `embed_dim` are divided by tp on every attention module.
"""

from __future__ import annotations

from torch import nn

from cx_shardformer._conv1d import GPT2FusedLinearConv1D_Col, GPT2FusedLinearConv1D_Row
from cx_shardformer._policy import ModulePolicyDescription, SubModuleReplacementDescription
from cx_shardformer.policies._common import HFDecoderPolicy, check_divisible, divide_attributes
from cx_shardformer.policies._sequence import apply_sequence_parallelism, check_sequence_parallelism

__all__ = ["GPT2LMHeadModelPolicy", "GPT2Policy"]


class GPT2Policy(HFDecoderPolicy):
    """`GPT2Model` (and the base of `GPT2LMHeadModel`)."""

    embedding_path = "wte"
    layers_path = "h"
    norm_path = "ln_f"
    decoder_layer = "GPT2Block"
    attention_name = "attn"

    def config_sanity_check(self) -> None:
        config = self.hf_config
        self.reject_expert_parallelism()
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError(
                f"{type(self.model).__name__}: cross-attention GPT-2 is not supported; use add_cross_attention=False"
            )
        if self.shard_config.enable_tensor_parallelism:
            check_divisible(self.model, "n_head", config.n_head, self.tp_size)
            inner = config.n_inner if config.n_inner is not None else 4 * config.n_embd
            check_divisible(self.model, "n_inner", inner, self.tp_size)
        check_sequence_parallelism(self)

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        split_gather = self.shard_config.sequence_parallelism_mode == "split_gather"
        row = {"seq_parallel_mode": "split_gather"} if split_gather else {}
        subs = [
            SubModuleReplacementDescription("attn.c_attn", GPT2FusedLinearConv1D_Col, kwargs={"n_fused": 3}),
            SubModuleReplacementDescription("attn.c_proj", GPT2FusedLinearConv1D_Row, kwargs=row),
            SubModuleReplacementDescription("mlp.c_fc", GPT2FusedLinearConv1D_Col, kwargs={"n_fused": 1}),
            SubModuleReplacementDescription("mlp.c_proj", GPT2FusedLinearConv1D_Row, kwargs=row),
        ]
        return {
            self.decoder_layer: ModulePolicyDescription(sub_module_replacement=subs),
            "GPT2Attention": ModulePolicyDescription(
                param_replacement=[divide_attributes(("split_size", "num_heads", "embed_dim"), self.tp_size)]
            ),
        }

    def postprocess(self) -> nn.Module:
        if self.shard_config.enable_tensor_parallelism:
            self.shard_vocab()
        apply_sequence_parallelism(self)
        self.share_input_reduction()
        self.apply_switches()
        return self.model


class GPT2LMHeadModelPolicy(GPT2Policy):
    """`GPT2LMHeadModel`: the base under `transformer.`, the tied vocabulary-parallel head and its loss."""

    embedding_path = "transformer.wte"
    layers_path = "transformer.h"
    norm_path = "transformer.ln_f"
