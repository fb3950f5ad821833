"""Checked policies for transformers 5's MoE decoders: Mixtral, Qwen3-MoE and DeepSeek-V3.

Attention is tensor-parallel as in the Llama policy (q/k/v column, o row; whole key/value heads per rank), except
DeepSeek-V3's multi-head latent attention, which stays replicated (see `DeepseekV3Policy`). Dense MLPs (Qwen3-MoE's
`mlp_only_layers`, DeepSeek-V3's first dense layers and its shared experts) are gate/up column, down row. The MoE
blocks are made expert-parallel over `ShardConfig.ep_group` by cx-moe's `expert_parallelize_hf`, which keeps the
router, routing and aux loss transformers' own and the parameter names unchanged; with no ep group (or ep size 1)
the experts stay whole. Experts are replicated over the tensor-parallel group: every TP rank runs the same tokens
through them, so their gradients need no TP reduction. Tensor parallelism inside experts is not implemented.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from cx_moe import expert_parallelize_hf
from cx_shardformer._linear import Linear1D_Col, Linear1D_Row, sync_grad_over
from cx_shardformer._policy import ModulePolicyDescription, SubModuleReplacementDescription
from cx_shardformer._sharder import get_submodule_or_none
from cx_shardformer.policies._common import HFDecoderPolicy, check_divisible

__all__ = [
    "DeepseekV3ForCausalLMPolicy",
    "DeepseekV3Policy",
    "MixtralForCausalLMPolicy",
    "MixtralPolicy",
    "MoEDecoderPolicy",
    "Qwen3MoeForCausalLMPolicy",
    "Qwen3MoePolicy",
]


class MoEDecoderPolicy(HFDecoderPolicy):
    """Base of the MoE decoder policies. Subclasses name the decoder layer, the dense MLP class (None: none), the
    per-head norms inside attention (their gradients are summed over tp: each rank normalises only its heads), the
    config field holding the expert count, and whether attention is tensor-parallel."""

    embedding_path = "embed_tokens"
    layers_path = "layers"
    norm_path = "norm"
    decoder_layer = ""
    dense_mlp: str | None = None
    head_norms: tuple[str, ...] = ()
    experts_field = ""
    attention_tp = True
    # Tensor parallelism inside each expert (ColossalAI's moe_tp) is not implemented: set True to get a clear error.
    expert_tensor_parallel = False

    @property
    def ep_size(self) -> int:
        group = self.shard_config.ep_group
        return 1 if group is None else int(dist.get_world_size(group))

    def config_sanity_check(self) -> None:
        config, name = self.hf_config, type(self.model).__name__
        if self.expert_tensor_parallel:
            raise NotImplementedError(f"{name}: tensor parallelism inside experts is not implemented in cx-shardformer")
        if self.shard_config.enable_sequence_parallelism:
            raise NotImplementedError(
                f"{name}: sequence parallelism is not implemented for MoE policies (the MoE blocks would route "
                "sequence shards); pass enable_sequence_parallelism=False"
            )
        if self.shard_config.enable_tensor_parallelism:
            if self.attention_tp:
                check_divisible(self.model, "num_attention_heads", config.num_attention_heads, self.tp_size)
                check_divisible(self.model, "num_key_value_heads", config.num_key_value_heads, self.tp_size)
            for module in self.model.modules():
                if self.dense_mlp is not None and type(module).__name__ == self.dense_mlp:
                    size = int(getattr(module, "intermediate_size"))  # noqa: B009  (transformers' MLP attribute)
                    check_divisible(self.model, "dense MLP intermediate_size", size, self.tp_size)
        check_divisible(self.model, self.experts_field, int(getattr(config, self.experts_field)), self.ep_size, "ep")

    def preprocess(self) -> nn.Module:
        """Experts split over the ep group first: cx-moe checks every block (and the groups, on every ep rank)
        before changing any, so a bad layout fails before tensor parallelism has touched the model."""
        group = self.shard_config.ep_group
        if group is not None and self.ep_size > 1:
            expert_parallelize_hf(self.model, group, self.shard_config.moe_dp_group)
        return self.model

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        policy: dict[type[nn.Module] | str, ModulePolicyDescription] = {}
        if self.attention_tp:
            attention = [
                SubModuleReplacementDescription("self_attn.q_proj", Linear1D_Col),
                SubModuleReplacementDescription("self_attn.k_proj", Linear1D_Col),
                SubModuleReplacementDescription("self_attn.v_proj", Linear1D_Col),
                SubModuleReplacementDescription("self_attn.o_proj", Linear1D_Row),
            ]
            policy[self.decoder_layer] = ModulePolicyDescription(sub_module_replacement=attention)
        if self.dense_mlp is not None:
            mlp = [
                SubModuleReplacementDescription("gate_proj", Linear1D_Col),
                SubModuleReplacementDescription("up_proj", Linear1D_Col),
                SubModuleReplacementDescription("down_proj", Linear1D_Row),
            ]
            policy[self.dense_mlp] = ModulePolicyDescription(sub_module_replacement=mlp)
        return policy

    def reduction_sharing_blocks(self, layer: nn.Module) -> tuple[str, ...]:
        """Attention when it is tensor-parallel, the MLP only when it is dense: an MoE block is replicated over tp
        (its router and experts must not see a summed input gradient), and its shared experts' column layers reduce
        their own input gradients."""
        blocks = (self.attention_name,) if self.attention_tp else ()
        mlp = get_submodule_or_none(layer, self.mlp_name)
        if mlp is not None and type(mlp).__name__ == self.dense_mlp:
            blocks = (*blocks, self.mlp_name)
        return blocks

    def postprocess(self) -> nn.Module:
        if self.shard_config.enable_tensor_parallelism:
            self.shard_vocab()
            if self.attention_tp:
                group = self.shard_config.tensor_parallel_process_group
                for layer in self.decoder_layers():
                    for norm in self.head_norms:
                        module = get_submodule_or_none(layer, f"{self.attention_name}.{norm}")
                        for param in module.parameters() if module is not None else ():
                            sync_grad_over(param, group)
        self.share_input_reduction()
        self.apply_switches()
        return self.model


class _CausalLM:
    """Paths of a `*ForCausalLM`: the base model under `model.`."""

    embedding_path = "model.embed_tokens"
    layers_path = "model.layers"
    norm_path = "model.norm"


class MixtralPolicy(MoEDecoderPolicy):
    """`MixtralModel`: GQA attention tensor-parallel, every MLP an MoE block (`MixtralSparseMoeBlock`)."""

    decoder_layer = "MixtralDecoderLayer"
    experts_field = "num_local_experts"


class MixtralForCausalLMPolicy(_CausalLM, MixtralPolicy):
    """`MixtralForCausalLM`: plus the vocabulary-parallel LM head and loss (the aux loss stays transformers')."""


class Qwen3MoePolicy(MoEDecoderPolicy):
    """`Qwen3MoeModel`: GQA attention tensor-parallel with its per-head q/k RMSNorms replicated (gradients summed
    over tp), dense `Qwen3MoeMLP` layers (`mlp_only_layers`) tensor-parallel, MoE blocks expert-parallel."""

    decoder_layer = "Qwen3MoeDecoderLayer"
    dense_mlp = "Qwen3MoeMLP"
    head_norms = ("q_norm", "k_norm")
    experts_field = "num_experts"


class Qwen3MoeForCausalLMPolicy(_CausalLM, Qwen3MoePolicy):
    """`Qwen3MoeForCausalLM`."""


class DeepseekV3Policy(MoEDecoderPolicy):
    """`DeepseekV3Model`: the dense first layers' MLPs and every MoE block's shared experts (`DeepseekV3MLP`)
    tensor-parallel, routed experts expert-parallel. Multi-head latent attention stays replicated over tp: its
    low-rank k/v projection also yields the rotary key shared by all heads, so splitting heads would leave that
    path with partial gradients mixed into full ones; cx keeps it whole rather than risk a wrong gradient."""

    decoder_layer = "DeepseekV3DecoderLayer"
    dense_mlp = "DeepseekV3MLP"
    experts_field = "n_routed_experts"
    attention_tp = False


class DeepseekV3ForCausalLMPolicy(_CausalLM, DeepseekV3Policy):
    """`DeepseekV3ForCausalLM`."""
