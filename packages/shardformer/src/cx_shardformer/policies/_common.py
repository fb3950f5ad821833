"""Pieces every Hugging Face decoder policy shares: divisibility checks with clear messages, per-rank attribute
counts, the vocabulary-parallel LM head and its loss, the ShardConfig switches (SDPA attention, torch's fused
RMSNorm, per-layer activation checkpointing) and the dropout streams of sharded activations."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from cx_shardformer._comm import copy_to_parallel
from cx_shardformer._config import SequenceParallelMode, ShardConfig
from cx_shardformer._ids import FirstCalls
from cx_shardformer._linear import mark_input_grad_reduced
from cx_shardformer._loss import cross_entropy_1d
from cx_shardformer._policy import Policy
from cx_shardformer._sharder import get_submodule_or_none, set_submodule
from cx_shardformer._vocab import VocabParallelEmbedding1D, VocabParallelLMHead1D
from cx_shardformer.policies._dropout import install_dropout_streams
from cx_shardformer.policies._fused import apply_jit_fused
from cx_shardformer.policies._fused_norm import fuse_rms_norms

__all__ = [
    "HFDecoderPolicy",
    "VocabParallelCausalLMLoss",
    "check_divisible",
    "divide_attributes",
]


def check_divisible(model: nn.Module, what: str, value: int, parallel: int, kind: str = "tensor parallel") -> None:
    """Raise a ValueError naming the model, the quantity and both numbers when `value` does not divide."""
    if value % parallel != 0:
        options = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"{type(model).__name__}: {what}={value} is not divisible by the {kind} size {parallel}; "
            f"sizes that divide it: {options}"
        )


def divide_attributes(names: tuple[str, ...], parallel: int) -> Any:
    """A `param_replacement` function that divides the named integer attributes (when present) by `parallel`."""

    def adjust(module: nn.Module) -> None:
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, name, value // parallel)

    return adjust


class VocabParallelCausalLMLoss:
    """transformers' causal-LM loss (`ForCausalLMLoss` signature) over vocabulary-parallel logits."""

    def __init__(self, shard_config: ShardConfig) -> None:
        self.group = shard_config.tensor_parallel_process_group
        self._exact_label_check = FirstCalls()  # the first calls name a bad label; later ones assert on the device

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | int | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if shift_labels is None:
            padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        exact = self._exact_label_check()
        if num_items_in_batch is None:
            return cross_entropy_1d(logits, shift_labels, ignore_index, self.group, vocab_size, exact_label_check=exact)
        total = cross_entropy_1d(
            logits, shift_labels, ignore_index, self.group, vocab_size, mode="sum", exact_label_check=exact
        )
        return total / torch.as_tensor(num_items_in_batch, device=total.device)


class HFDecoderPolicy(Policy):
    """Base of the Hugging Face decoder policies: subclasses say where the embedding, head, layers and norms are."""

    embedding_path = ""  # relative to the model, e.g. "model.embed_tokens"
    lm_head_path = "lm_head"
    layers_path = ""  # the ModuleList of decoder layers
    norm_path = ""  # the final norm (sequence parallelism gathers after it)
    attention_name = "self_attn"  # inside a decoder layer
    mlp_name = "mlp"
    # True when every column layer in an attention / MLP block reads the block input itself (not a derived tensor)
    # and the block has no path from input to output that bypasses its sharded layers (no residual inside): then
    # one reduction per block input replaces one per column layer. Checked policies verify this for their model; the
    # generic policy cannot, and keeps one all-reduce per column layer (always correct).
    shares_block_reductions = True
    # dropout modules inside the attention module that act on the attention probabilities (this rank's heads); every
    # other dropout module in a decoder layer acts on the hidden states (`_dropout`)
    attention_probability_dropouts: tuple[str, ...] = ("attn_dropout", "attention_dropout")

    @property
    def tp_size(self) -> int:
        return self.shard_config.tensor_parallel_size

    @property
    def hf_config(self) -> Any:
        config = getattr(self.model, "config", None)
        if config is None:
            raise TypeError(f"{type(self).__name__}: {type(self.model).__name__} has no Hugging Face config")
        return config

    def reject_expert_parallelism(self) -> None:
        """Dense policies: an ep group of more than one rank would be ignored, so it raises instead."""
        group = self.shard_config.ep_group
        if group is not None and dist.get_world_size(group) > 1:
            raise ValueError(
                f"{type(self).__name__} shards {type(self.model).__name__} without expert parallelism; ep_group has "
                f"{dist.get_world_size(group)} ranks (pass ep_group=None, or use an MoE policy)"
            )

    def decoder_layers(self) -> list[nn.Module]:
        layers = get_submodule_or_none(self.model, self.layers_path)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"{type(self).__name__}: no decoder layer list at {self.layers_path!r}")
        return list(layers)

    def has_lm_head(self) -> bool:
        head = get_submodule_or_none(self.model, self.lm_head_path)
        return isinstance(head, nn.Linear | VocabParallelLMHead1D)

    def shard_vocab(self) -> None:
        """Embedding and LM head made vocabulary-parallel (a tied head adopts the embedding's shard)."""
        config = self.shard_config
        group = config.tensor_parallel_process_group
        embedding = get_submodule_or_none(self.model, self.embedding_path)
        if isinstance(embedding, nn.Embedding):
            new = VocabParallelEmbedding1D.from_native_module(
                embedding, group, make_vocab_size_divisible_by=config.make_vocab_size_divisible_by
            )
            set_submodule(self.model, self.embedding_path, new)
        head = get_submodule_or_none(self.model, self.lm_head_path)
        if isinstance(head, nn.Linear):
            new_head = VocabParallelLMHead1D.from_native_module(
                head,
                group,
                make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
                gather_output=not config.parallel_output,
            )
            set_submodule(self.model, self.lm_head_path, new_head)
            if config.parallel_output:
                if not hasattr(type(self.model), "loss_function"):
                    raise TypeError(
                        f"{type(self.model).__name__}: parallel_output=True needs a transformers model with a "
                        "settable loss_function; pass parallel_output=False"
                    )
                setattr(self.model, "loss_function", VocabParallelCausalLMLoss(config))  # noqa: B010  (typed as Module attr)

    def reduction_sharing_blocks(self, layer: nn.Module) -> tuple[str, ...]:
        """The blocks of one decoder layer whose column layers share one input reduction (all of them read the
        block input, and the block is tensor-parallel as a whole). Default: attention and MLP."""
        return (self.attention_name, self.mlp_name)

    def sequence_gathered_blocks(self, layer: nn.Module) -> tuple[str, ...]:
        """split_gather: the blocks of one decoder layer whose input is all-gathered along the sequence (their
        column/row layers work on the full sequence). Default: attention and MLP."""
        return (self.attention_name, self.mlp_name)

    def share_input_reduction(self) -> None:
        """One backward all-reduce per attention / MLP block input instead of one per column layer (q, k, v; gate,
        up): a pre-hook applies `copy_to_parallel` to the block input and marks it for the column layers. Only
        without split_gather, whose block-level gather does the same job."""
        config = self.shard_config
        if not self.shares_block_reductions or not config.enable_tensor_parallelism:
            return
        if config.sp_mode is SequenceParallelMode.SPLIT_GATHER:
            return
        group = config.tensor_parallel_process_group

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden, torch.Tensor):
                return args, kwargs
            shared = copy_to_parallel(hidden, group, config.fp8_communication)
            mark_input_grad_reduced(shared, group)
            if args:
                return (shared, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": shared}

        for layer in self.decoder_layers():
            for child in self.reduction_sharing_blocks(layer):
                block = get_submodule_or_none(layer, child)
                if block is not None:
                    block.register_forward_pre_hook(hook, with_kwargs=True)

    def apply_switches(self) -> None:
        """enable_flash_attention, enable_fused_normalization, enable_jit_fused and gradient_checkpoint_config; and
        the dropout streams of sharded activations (`_dropout`), which every policy needs and which must come after
        sharding."""
        install_dropout_streams(self)
        config = self.shard_config
        attention_sp = config.sp_mode in (SequenceParallelMode.ALL_TO_ALL, SequenceParallelMode.RING)
        if config.enable_flash_attention and not attention_sp:  # the SP modes install their own attention
            setter = getattr(self.model, "set_attn_implementation", None)
            if setter is None:
                raise TypeError(f"{type(self.model).__name__}: enable_flash_attention needs set_attn_implementation")
            setter("sdpa")
        if config.enable_fused_normalization:
            fuse_rms_norms(self.model)
        if config.enable_jit_fused:  # after fused normalization, which covers the norms it replaces
            apply_jit_fused(self.model, config)
        if config.gradient_checkpoint_config is not None:
            layers = self.decoder_layers()
            count = config.gradient_checkpoint_config.get_num_ckpt_layers(len(layers))
            for layer in layers[:count]:
                enable_checkpointing(layer)


def enable_checkpointing(layer: nn.Module) -> None:
    """Turn on activation checkpointing for one transformers decoder layer (a `GradientCheckpointingLayer`)."""
    if not hasattr(type(layer), "gradient_checkpointing"):
        raise TypeError(
            f"gradient_checkpoint_config: {type(layer).__name__} is not a transformers GradientCheckpointingLayer"
        )
    setattr(layer, "gradient_checkpointing", True)  # noqa: B010  (transformers' flag, not a Module attribute type)
    setattr(layer, "_gradient_checkpointing_func", functools.partial(checkpoint, use_reentrant=False))  # noqa: B010
