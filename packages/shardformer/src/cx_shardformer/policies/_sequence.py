"""Sequence parallelism for the Hugging Face decoder policies.

The hidden states are split along the sequence at the first decoder layer's input (after the model computed its
rotary tables and causal mask for the full sequence) and gathered again after the final norm, so the model's
logits and loss cover the full sequence. In between:
- split_gather (Megatron, TP group): attention and MLP inputs are all-gathered once per block (reduce-scatter
  backward, which already sums the column layers' input gradients, so they skip their own all-reduce); the row
  layers reduce-scatter their outputs; norms work on sequence shards.
- all_to_all (Ulysses, SP group): the registered `cx_ulysses` attention swaps sequence for heads before attention and
  back after it; key/value heads that do not divide the SP size are repeated first (grouped-query attention).
- ring (SP group): the registered `cx_ring` attention runs ring attention on a zig-zag split; its registered mask
  function keeps the model's mask as key spans (packed documents: causal within each document, no [S, S] mask).
Replicated parameters applied to sequence shards get their gradients summed over the group (`sync_grad_over`), so
every rank ends backward with the full-sequence gradient (a data-parallel average over sp is then a no-op).

Under a pipeline (`shard_sequence_at_stage`) each stage sends the next only its sequence shard. A later stage places
the shard it receives at its own positions of a zero, full-length tensor, so the model's own forward computes the
rotary tables and the causal mask of the full sequence as on the first stage, and its first layer picks the shard out
again (no collective: both are local index operations, whose backward passes the shard's gradient straight back).
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh import ProcessGroup
from cx_shardformer._comm import (
    all_to_all,
    gather_forward_reduce_scatter_backward,
    gather_forward_split_backward,
    group_rank,
    group_size,
    split_forward_gather_backward,
)
from cx_shardformer._config import SequenceParallelMode
from cx_shardformer._linear import mark_input_grad_reduced, sync_grad_over
from cx_shardformer._ring import ring_attention, zigzag_order, zigzag_positions
from cx_shardformer._shard_spec import get_shard_spec
from cx_shardformer._sharder import get_submodule_or_none
from cx_shardformer._spans import KeySpans
from cx_shardformer.policies._decoder import DecoderPolicy
from cx_shardformer.policies._overlap import block_gather_hook
from cx_shardformer.policies._ring_mask import ring_mask

__all__ = ["apply_sequence_parallelism", "check_sequence_parallelism", "shard_sequence_at_stage"]

_ATTENTION_NAMES = {SequenceParallelMode.ALL_TO_ALL: "cx_ulysses", SequenceParallelMode.RING: "cx_ring"}


def check_sequence_parallelism(policy: DecoderPolicy) -> None:
    """Head counts against tp * sp, and the transformers hooks the attention modes need."""
    config = policy.shard_config
    mode = config.sp_mode
    if mode is None:
        return
    sp = config.sequence_parallel_size
    tp = config.tensor_parallel_size
    heads = getattr(policy.hf_config, "num_attention_heads", None)
    if mode is SequenceParallelMode.ALL_TO_ALL and isinstance(heads, int) and (heads // tp) % sp != 0:
        raise ValueError(
            f"{type(policy.model).__name__}: all_to_all sequence parallelism scatters the {heads // tp} attention "
            f"heads each tensor-parallel rank holds (num_attention_heads={heads}, tp={tp}) over sp={sp} ranks; "
            f"{heads // tp} is not divisible by {sp}"
        )
    if mode in _ATTENTION_NAMES and not hasattr(policy.model, "set_attn_implementation"):
        raise TypeError(
            f"{type(policy.model).__name__}: {mode.value} sequence parallelism registers a transformers attention "
            "function and needs a transformers model (set_attn_implementation)"
        )


def _hidden(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    value = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(value, torch.Tensor):
        raise TypeError("sequence parallelism: the decoder layer received no hidden_states tensor")
    return value


def _with_hidden(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: torch.Tensor) -> tuple[Any, dict[str, Any]]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


class _Sequence:
    """The hooks of one sharded model; `mode` and `group` fixed at optimize time."""

    def __init__(
        self,
        mode: SequenceParallelMode,
        group: ProcessGroup | None,
        model_name: str,
        shared_reduction: bool,
        fp8: bool = False,
    ) -> None:
        self.mode, self.group, self.model_name = mode, group, model_name
        self.fp8 = fp8  # fp8_communication: the sequence gathers / scatters through cx_mesh.fp8
        self.shared_reduction = shared_reduction
        self.world = group_size(group)

    def _check_length(self, seq_len: int) -> None:
        parts = 2 * self.world if self.mode is SequenceParallelMode.RING else self.world
        if seq_len % parts != 0:
            extra = (
                " (ring attention's balanced zig-zag split cuts it into 2 * sp chunks)" if parts != self.world else ""
            )
            raise ValueError(
                f"{self.model_name}: sequence length {seq_len} is not divisible by {parts} for {self.mode.value} "
                f"sequence parallelism over {self.world} ranks{extra}; pad the batch to a multiple of {parts}"
            )

    def split(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        hidden = _hidden(args, kwargs)
        self._check_length(hidden.shape[1])
        if self.mode is SequenceParallelMode.RING:
            hidden = hidden.index_select(1, zigzag_order(hidden.shape[1], self.world, hidden.device))
        return _with_hidden(args, kwargs, split_forward_gather_backward(hidden, 1, self.group, self.fp8))

    def _own_positions(self, full: int, device: torch.device) -> torch.Tensor:
        """Positions in the full sequence of this rank's tokens, in the order its shard holds them."""
        rank = group_rank(self.group)
        if self.mode is SequenceParallelMode.RING:
            return zigzag_positions(full, rank, self.world, device)
        local = full // self.world
        return torch.arange(rank * local, (rank + 1) * local, device=device)

    def positions(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Cut the full-sequence rotary tables down to this rank's tokens (attention modes only)."""
        tables = kwargs.get("position_embeddings")
        full = _hidden(args, kwargs).shape[1] * self.world
        if not isinstance(tables, tuple) or not all(isinstance(t, torch.Tensor) for t in tables):
            return args, kwargs
        index = self._own_positions(full, tables[0].device)
        cut = tuple(t.index_select(1, index) if t.shape[1] == full else t for t in tables)
        return args, {**kwargs, "position_embeddings": cut}

    def widen(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A later pipeline stage's input: the received shard placed at its positions of a zero full sequence."""
        shard = kwargs.get("hidden_states")
        if not isinstance(shard, torch.Tensor):
            raise TypeError(
                f"{self.model_name}: a pipeline stage of a sequence-parallel model must receive the previous stage's "
                f"output as the keyword hidden_states; {type(module).__name__} got {sorted(kwargs)}"
            )
        full = shard.shape[1] * self.world
        wide = shard.new_zeros(shard.shape[0], full, *shard.shape[2:])
        wide = wide.index_copy(1, self._own_positions(full, shard.device), shard)
        return args, {**kwargs, "hidden_states": wide}

    def narrow(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The first layer of a later stage: this rank's shard of the widened sequence."""
        hidden = _hidden(args, kwargs)
        return _with_hidden(args, kwargs, hidden.index_select(1, self._own_positions(hidden.shape[1], hidden.device)))

    def gather_input(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        if self.shared_reduction:
            # one reduce-scatter sums the column layers' partial input gradients; they skip their all-reduce
            hidden = gather_forward_reduce_scatter_backward(_hidden(args, kwargs), 1, self.group, self.fp8)
            mark_input_grad_reduced(hidden, self.group)
        else:
            # the column layers all-reduce their own input gradients, so the gathered gradient is already whole
            hidden = gather_forward_split_backward(_hidden(args, kwargs), 1, self.group, self.fp8)
        return _with_hidden(args, kwargs, hidden)

    def gather_output(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        full = gather_forward_split_backward(output, 1, self.group, self.fp8)
        if self.mode is SequenceParallelMode.RING:
            inverse = torch.argsort(zigzag_order(full.shape[1], self.world, full.device))
            full = full.index_select(1, inverse)
        return full


_GROUP = "cx_sp_group"
_FP8 = "cx_sp_fp8"  # fp8_communication: the Ulysses all-to-alls through cx_mesh.fp8

# each sequence-parallel model's hooks and decoder layers, for the pipeline stages cut from it later
_SEQUENCES: WeakKeyDictionary[nn.Module, tuple[_Sequence, list[nn.Module]]] = WeakKeyDictionary()


def shard_sequence_at_stage(model: nn.Module, stage: nn.Module) -> None:
    """Let `stage`, a pipeline stage cut from `model` after ShardFormer sharded it, take the sequence shard the
    previous stage sends (module docs). A no-op for a model without sequence parallelism and for the stage holding
    the first decoder layer, which splits the full sequence itself."""
    found = _SEQUENCES.get(model)
    if found is None:
        return
    sequence, layers = found
    position = {id(layer): i for i, layer in enumerate(layers)}
    held = [module for module in stage.modules() if id(module) in position]
    if not held:
        raise ValueError(f"{sequence.model_name}: the pipeline stage {type(stage).__name__} holds no decoder layer")
    first = min(held, key=lambda layer: position[id(layer)])
    if position[id(first)] == 0:
        return
    stage.register_forward_pre_hook(sequence.widen, with_kwargs=True)
    # before the layer's own hooks (the rotary-table cut reads the shard's length)
    first.register_forward_pre_hook(sequence.narrow, with_kwargs=True, prepend=True)


def _sp_group(module: nn.Module) -> ProcessGroup | None:
    group: ProcessGroup | None = getattr(module, _GROUP)
    return group


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: all-to-all (sequence -> heads), SDPA on the full sequence, all-to-all back."""
    group, fp8 = _sp_group(module), bool(getattr(module, _FP8, False))
    sp = group_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % sp != 0:  # fewer key/value heads than ranks: repeat them (grouped-query attention)
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    query = all_to_all(query, 1, 2, group, fp8)
    key = all_to_all(key, 1, 2, group, fp8)
    value = all_to_all(value, 1, 2, group, fp8)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    mask = attention_mask[..., : key.shape[2]] if attention_mask is not None else None
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling
    )
    out = all_to_all(out, 2, 1, group, fp8)
    return out.transpose(1, 2).contiguous(), None


def ring_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | KeySpans | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ring attention on the zig-zag split (the mask from `ring_mask`)."""
    if dropout > 0.0:
        raise NotImplementedError("ring sequence parallelism: attention dropout is not supported; set it to 0")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query, key, value, _sp_group(module), scale, attention_mask)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("cx_ulysses", ulysses_attention_forward)
    AttentionInterface.register("cx_ring", ring_attention_forward)
    # Ulysses runs SDPA on the whole sequence with transformers' own (dense, when not plain causal) mask; ring
    # attention takes the same mask as key spans when it can (packed documents: no [S, S] tensor)
    AttentionMaskInterface.register("cx_ulysses", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register("cx_ring", ring_mask)


def apply_sequence_parallelism(policy: DecoderPolicy) -> None:
    """Install the hooks (and the attention function) of the configured mode on `policy.model`."""
    config = policy.shard_config
    mode = config.sp_mode
    if mode is None:
        return
    model = policy.model
    sequence = _Sequence(
        mode, config.sp_group, type(model).__name__, policy.shares_block_reductions, config.fp8_communication
    )
    layers = policy.decoder_layers()
    _SEQUENCES[model] = (sequence, layers)
    layers[0].register_forward_pre_hook(sequence.split, with_kwargs=True)
    norm = get_submodule_or_none(model, policy.norm_path)
    if norm is None:
        raise TypeError(f"{type(policy).__name__}: no final norm at {policy.norm_path!r}")
    if mode is SequenceParallelMode.SPLIT_GATHER:
        for layer in layers:
            for child in policy.sequence_gathered_blocks(layer):
                block = get_submodule_or_none(layer, child)
                if block is None:
                    raise TypeError(f"{type(policy).__name__}: decoder layer has no {child!r}")
                hook = block_gather_hook(policy, block, sequence.gather_input)  # a ring with enable_sequence_overlap
                block.register_forward_pre_hook(hook, with_kwargs=True)
    else:
        _register_attention()
        for layer in layers:
            layer.register_forward_pre_hook(sequence.positions, with_kwargs=True)
            attention = get_submodule_or_none(layer, policy.attention_name)
            if attention is None:
                raise TypeError(f"{type(policy).__name__}: decoder layer has no {policy.attention_name!r}")
            setattr(attention, _GROUP, config.sp_group)
            setattr(attention, _FP8, config.fp8_communication)
        getattr(model, "set_attn_implementation")(_ATTENTION_NAMES[mode])  # noqa: B009  (transformers only)
    # gathered after the final norm, before any reshape the model makes of the full sequence (GPT-2 views it)
    norm.register_forward_hook(sequence.gather_output)
    for module in [*layers, norm]:
        for param in module.parameters():
            if mode is not SequenceParallelMode.SPLIT_GATHER or get_shard_spec(param) is None:
                sync_grad_over(param, config.sp_group)
