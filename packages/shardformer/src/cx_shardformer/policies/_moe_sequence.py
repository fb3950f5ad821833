"""Sequence parallelism for MoE blocks: each rank routes the tokens of its own sequence shard, while the aux
load-balancing loss still pools every token of the sequence, as transformers' does on one process.

transformers records each router's logits with a forward hook (`OutputRecorder(..., index=0)`) and computes the aux
loss from them after the final norm; the MoE block itself only uses the router's top-k weights and indices. So a
forward hook, placed before transformers' own, replaces the recorded logits of the local shard [B * S_local, E] by
the whole sequence's [B * S, E]: gathered over the sequence-parallel group along the sequence (back in the original
token order after ring attention's zig-zag split), batch-major as the attention mask is flattened. Every rank then
computes the same full aux loss, and the gather's backward keeps this rank's slice of its gradient, so the router's
gradient is this shard's share, summed over the group like every replicated parameter's. The gather runs on every
forward (the router cannot tell whether transformers records its output); it moves [B * S, E] fp32 per MoE layer,
small next to the hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cx_shardformer._comm import gather_forward_split_backward, group_size
from cx_shardformer._config import SequenceParallelMode
from cx_shardformer._ring import zigzag_order
from cx_shardformer._sharder import get_submodule_or_none
from cx_shardformer.policies._decoder import DecoderPolicy

__all__ = ["gather_router_logits"]

_BATCH = "cx_sp_batch_size"


def gather_router_logits(policy: DecoderPolicy) -> int:
    """Install the gather on the router (`block.gate`) of every MoE block; returns how many were found."""
    config = policy.shard_config
    mode, group = config.sp_mode, config.sp_group
    if mode is None or group_size(group) == 1:
        return 0
    world = group_size(group)
    count = 0
    for layer in policy.decoder_layers():
        block = get_submodule_or_none(layer, policy.mlp_name)
        router = getattr(block, "gate", None) if block is not None else None
        if block is None or not isinstance(router, nn.Module) or not hasattr(block, "experts"):
            continue  # a dense MLP: nothing routed

        def remember_batch(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], router: nn.Module = router
        ) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor):
                setattr(router, _BATCH, int(hidden.shape[0]))

        def gather(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not isinstance(output, tuple) or not output or not isinstance(output[0], torch.Tensor):
                return output
            logits: torch.Tensor = output[0]
            batch = int(getattr(module, _BATCH, 1))
            local = logits.reshape(batch, -1, logits.shape[-1])
            full = gather_forward_split_backward(local, 1, group)
            if mode is SequenceParallelMode.RING:
                inverse = torch.argsort(zigzag_order(full.shape[1], world, full.device))
                full = full.index_select(1, inverse)
            return (full.reshape(-1, logits.shape[-1]), *output[1:])

        block.register_forward_pre_hook(remember_batch, with_kwargs=True)
        router.register_forward_hook(gather, prepend=True)  # before transformers' recorder, whenever it is installed
        count += 1
    return count
