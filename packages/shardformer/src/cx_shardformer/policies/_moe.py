"""Checked policies for transformers 5's MoE decoders: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3.

Attention is tensor-parallel as in the Llama policy (q/k/v column, o row; whole key/value heads per rank);
DeepSeek-V3's multi-head latent attention is split by heads too (see `DeepseekV3Policy`). Dense MLPs (Qwen3-MoE's
`mlp_only_layers`, Qwen2-MoE's and DeepSeek-V3's shared experts, DeepSeek-V3's first dense layers) are gate/up
column, down row. The MoE blocks are made expert-parallel over `ShardConfig.ep_group` by cx-moe's
`expert_parallelize_hf`, which keeps the router, routing and aux loss transformers' own and the parameter names
unchanged; with no ep group (or ep size 1) the experts stay whole. By default experts are replicated over the
tensor-parallel group: every TP rank runs the same tokens through them, so their gradients need no TP reduction.
With `expert_tensor_parallel=True` each expert's intermediate dimension is split over tp as well (`_expert_tp`).

Sequence parallelism (`_sequence`) splits the sequence before the first layer as for dense models; an MoE block
routes the tokens of its rank's shard (under split_gather it is not gathered, unlike attention and dense MLPs), its
router and expert gradients are summed over the sequence-parallel group, and the router logits the aux loss reads are
gathered over that group (`_moe_sequence`), so the loss pools every token as on one process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_moe import expert_parallelize_hf
from cx_shardformer._config import SequenceParallelMode
from cx_shardformer._linear import Linear1D_Col, Linear1D_Row, mark_input_grad_reduced, sync_grad_over
from cx_shardformer._policy import ModulePolicyDescription, SubModuleReplacementDescription
from cx_shardformer._sharder import get_submodule_or_none
from cx_shardformer.policies._common import HFDecoderPolicy, check_divisible
from cx_shardformer.policies._expert_tp import check_expert_tensor_parallel, shard_experts_tensor_parallel
from cx_shardformer.policies._moe_sequence import gather_router_logits
from cx_shardformer.policies._sequence import apply_sequence_parallelism, check_sequence_parallelism

__all__ = [
    "DeepseekV3ForCausalLMPolicy",
    "DeepseekV3Policy",
    "MixtralForCausalLMPolicy",
    "MixtralPolicy",
    "MoEDecoderPolicy",
    "Qwen2MoeForCausalLMPolicy",
    "Qwen2MoePolicy",
    "Qwen3MoeForCausalLMPolicy",
    "Qwen3MoePolicy",
]


class MoEDecoderPolicy(HFDecoderPolicy):
    """Base of the MoE decoder policies. Subclasses name the decoder layer, the dense MLP class (None: none), the
    replicated modules inside attention whose gradients are summed over tp (each rank's copy only sees its own heads'
    gradient: per-head norms, MLA's low-rank projections), the column layers inside attention that read such a
    replicated module's output (their input gradient is only this rank's share and is summed at the attention input
    instead), and the config field holding the expert count."""

    embedding_path = "embed_tokens"
    layers_path = "layers"
    norm_path = "norm"
    decoder_layer = ""
    dense_mlp: str | None = None
    attention_replicated: tuple[str, ...] = ()
    attention_inner_columns: tuple[str, ...] = ()
    experts_field = ""
    # why split_gather sequence parallelism cannot be used (None: it can)
    split_gather_refusal: str | None = None

    def __init__(self, expert_tensor_parallel: bool = False) -> None:
        """`expert_tensor_parallel=True` also splits every expert's intermediate dimension over the TP group
        (`_expert_tp`); by default the experts are replicated over tp."""
        super().__init__()
        self.expert_tensor_parallel = expert_tensor_parallel

    @property
    def ep_size(self) -> int:
        group = self.shard_config.ep_group
        return 1 if group is None else int(dist.get_world_size(group))

    def config_sanity_check(self) -> None:
        config, name = self.hf_config, type(self.model).__name__
        if self.expert_tensor_parallel and not self.shard_config.enable_tensor_parallelism:
            raise ValueError(f"{name}: expert_tensor_parallel=True needs enable_tensor_parallelism=True")
        if self.shard_config.sp_mode is SequenceParallelMode.SPLIT_GATHER:
            self.check_split_gather()
        check_sequence_parallelism(self)
        if self.shard_config.enable_tensor_parallelism:
            self.check_attention()
            for module in self.model.modules():
                if self.dense_mlp is not None and type(module).__name__ == self.dense_mlp:
                    size = int(getattr(module, "intermediate_size"))  # noqa: B009  (transformers' MLP attribute)
                    check_divisible(self.model, "dense MLP intermediate_size", size, self.tp_size)
        check_divisible(self.model, self.experts_field, int(getattr(config, self.experts_field)), self.ep_size, "ep")
        if self.expert_tensor_parallel:
            check_expert_tensor_parallel(self.model, self.tp_size)
            ep_group = self.shard_config.ep_group
            if ep_group is not None and self.ep_size > 1:
                tp_ranks = dist.get_process_group_ranks(self.shard_config.tensor_parallel_process_group or _world())
                shared = sorted(set(tp_ranks) & set(dist.get_process_group_ranks(ep_group)))
                if len(shared) > 1:
                    raise ValueError(
                        f"{name}: expert_tensor_parallel needs the tp and ep groups to meet only in this rank (the tp "
                        f"ranks of an expert must hold the same experts); they share ranks {shared}"
                    )

    def check_split_gather(self) -> None:
        """split_gather gathers attention and dense-MLP inputs but not MoE blocks: experts split over tp (which need
        every token of the sequence) and tensor-parallel layers inside MoE blocks (shared experts) are refused."""
        name = type(self.model).__name__
        if self.split_gather_refusal is not None:
            raise NotImplementedError(
                f"{name}: split_gather sequence parallelism is not supported by cx for this model "
                f"({self.split_gather_refusal}); use all_to_all or ring_attn on the sp axis"
            )
        if self.expert_tensor_parallel:
            raise NotImplementedError(
                f"{name}: split_gather sequence parallelism with expert_tensor_parallel=True is not supported by cx "
                "(each rank routes its own sequence shard, so tp ranks cannot share an expert's intermediate "
                "dimension); use expert_tensor_parallel=False or all_to_all on the sp axis"
            )

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
        policy[self.decoder_layer] = ModulePolicyDescription(sub_module_replacement=self.attention_replacements())
        if self.dense_mlp is not None:
            mlp = [
                SubModuleReplacementDescription("gate_proj", Linear1D_Col),
                SubModuleReplacementDescription("up_proj", Linear1D_Col),
                SubModuleReplacementDescription("down_proj", Linear1D_Row, kwargs=self.row_kwargs()),
            ]
            policy[self.dense_mlp] = ModulePolicyDescription(sub_module_replacement=mlp)
        return policy

    def check_attention(self) -> None:
        """Whole query and key/value heads per rank."""
        config = self.hf_config
        check_divisible(self.model, "num_attention_heads", config.num_attention_heads, self.tp_size)
        check_divisible(self.model, "num_key_value_heads", config.num_key_value_heads, self.tp_size)

    def row_kwargs(self) -> dict[str, Any]:
        """Row layers reduce-scatter their output along the sequence under split_gather."""
        split_gather = self.shard_config.sp_mode is SequenceParallelMode.SPLIT_GATHER
        return {"seq_parallel_mode": "split_gather"} if split_gather else {}

    def attention_replacements(self) -> list[SubModuleReplacementDescription]:
        """q/k/v column, o row (grouped-query attention)."""
        return [
            SubModuleReplacementDescription("self_attn.q_proj", Linear1D_Col),
            SubModuleReplacementDescription("self_attn.k_proj", Linear1D_Col),
            SubModuleReplacementDescription("self_attn.v_proj", Linear1D_Col),
            SubModuleReplacementDescription("self_attn.o_proj", Linear1D_Row, kwargs=self.row_kwargs()),
        ]

    def sequence_gathered_blocks(self, layer: nn.Module) -> tuple[str, ...]:
        """split_gather: attention and dense MLPs work on the gathered sequence; an MoE block routes its shard."""
        return self.reduction_sharing_blocks(layer)

    def reduction_sharing_blocks(self, layer: nn.Module) -> tuple[str, ...]:
        """Attention, and the MLP only when it is dense: an MoE block is replicated over tp (its router and experts
        must not see a summed input gradient), and its shared experts' column layers reduce their own input
        gradients."""
        blocks: tuple[str, ...] = (self.attention_name,)
        mlp = get_submodule_or_none(layer, self.mlp_name)
        if mlp is not None and type(mlp).__name__ == self.dense_mlp:
            blocks = (*blocks, self.mlp_name)
        return blocks

    def postprocess(self) -> nn.Module:
        if self.shard_config.enable_tensor_parallelism:
            self.shard_vocab()
            self._finish_attention()
            if self.expert_tensor_parallel:
                shard_experts_tensor_parallel(self.model, self.shard_config.tensor_parallel_process_group)
        apply_sequence_parallelism(self)
        gather_router_logits(self)
        self.share_input_reduction()
        self.apply_switches()
        return self.model

    def _finish_attention(self) -> None:
        """Replicated modules inside attention get tp-summed gradients, and the inner column layers skip their own
        input reduction: both rely on the one all-reduce at the attention input that `share_input_reduction` installs
        (or, under split_gather, the reduce-scatter backward of the attention input's gather)."""
        group = self.shard_config.tensor_parallel_process_group

        def mark_input(module: nn.Module, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], torch.Tensor):
                mark_input_grad_reduced(args[0], group)

        for layer in self.decoder_layers():
            for name in self.attention_replicated:
                module = get_submodule_or_none(layer, f"{self.attention_name}.{name}")
                for param in module.parameters() if module is not None else ():
                    sync_grad_over(param, group)
            for name in self.attention_inner_columns:
                column = get_submodule_or_none(layer, f"{self.attention_name}.{name}")
                if column is not None:
                    column.register_forward_pre_hook(mark_input)


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError("torch.distributed is not initialised")
    return group


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
    attention_replicated = ("q_norm", "k_norm")
    experts_field = "num_experts"


class Qwen3MoeForCausalLMPolicy(_CausalLM, Qwen3MoePolicy):
    """`Qwen3MoeForCausalLM`."""


class Qwen2MoePolicy(MoEDecoderPolicy):
    """`Qwen2MoeModel`: GQA attention (q/k/v with biases) tensor-parallel, dense `Qwen2MoeMLP` layers and each MoE
    block's `shared_expert` (also a `Qwen2MoeMLP`) gate/up column, down row; the sigmoid `shared_expert_gate`
    stays replicated (it reads the whole block input, so its gradient is whole on every rank)."""

    decoder_layer = "Qwen2MoeDecoderLayer"
    dense_mlp = "Qwen2MoeMLP"
    experts_field = "num_experts"
    split_gather_refusal = "its shared experts are tensor-parallel layers inside the MoE blocks, which route shards"


class Qwen2MoeForCausalLMPolicy(_CausalLM, Qwen2MoePolicy):
    """`Qwen2MoeForCausalLM`."""


class DeepseekV3Policy(MoEDecoderPolicy):
    """`DeepseekV3Model`: multi-head latent attention split by heads, the dense first layers' MLPs and every MoE
    block's shared experts (`DeepseekV3MLP`) tensor-parallel, routed experts expert-parallel.

    In MLA the per-head projections (`q_proj` or `q_b_proj`, `kv_b_proj`) are column-parallel and `o_proj` row-parallel,
    while the low-rank projections and their norms (`q_a_proj`, `q_a_layernorm`, `kv_a_proj_with_mqa`,
    `kv_a_layernorm`) stay replicated: `kv_a_proj_with_mqa` also yields the rotary key shared by all heads. Inside
    the attention every gradient is therefore this rank's heads' share: the replicated parameters' gradients are
    summed over tp, the column layers skip their own input reduction, and one all-reduce at the attention input
    (the shared block reduction) makes the input gradient whole."""

    decoder_layer = "DeepseekV3DecoderLayer"
    dense_mlp = "DeepseekV3MLP"
    experts_field = "n_routed_experts"
    attention_replicated = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm")
    attention_inner_columns = ("q_b_proj", "kv_b_proj")
    split_gather_refusal = "its shared experts are tensor-parallel layers inside the MoE blocks, which route shards"

    def config_sanity_check(self) -> None:
        super().config_sanity_check()
        config = self.hf_config
        qk_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        if self.shard_config.sp_mode is SequenceParallelMode.RING and int(config.v_head_dim) != qk_dim:
            raise NotImplementedError(
                f"{type(self.model).__name__}: ring attention sequence parallelism needs value heads as wide as "
                f"query/key heads, and latent attention has v_head_dim={config.v_head_dim} vs {qk_dim}; use "
                "all_to_all"
            )

    def check_attention(self) -> None:
        """MLA expands its latent keys/values to one head per query head: only the query heads must divide."""
        config = self.hf_config
        check_divisible(self.model, "num_attention_heads", config.num_attention_heads, self.tp_size)

    def attention_replacements(self) -> list[SubModuleReplacementDescription]:
        def column(name: str) -> SubModuleReplacementDescription:
            return SubModuleReplacementDescription(f"self_attn.{name}", Linear1D_Col, ignore_if_not_exist=True)

        return [
            column("q_proj"),  # without q_lora_rank
            column("q_b_proj"),  # with q_lora_rank
            column("kv_b_proj"),
            SubModuleReplacementDescription("self_attn.o_proj", Linear1D_Row),
        ]


class DeepseekV3ForCausalLMPolicy(_CausalLM, DeepseekV3Policy):
    """`DeepseekV3ForCausalLM`."""
