"""ShardFormer policy for cx's reference `GPT` (tensor parallelism), registered with cx-shardformer's auto-selection
when `cx_plugins.models` is imported.

The fused `qkv` Linear becomes a `FusedLinear1D_Col` split part by part (local output [q_r, k_r, v_r]), `proj` a
`Linear1D_Row`; the MLP's first Linear is column-, its last row-parallel. The attention forward splits q/k/v by the
full hidden width, so it is replaced by one that splits the local output in three and uses the per-rank head count.
The tied embedding and LM head become vocabulary-parallel; with `parallel_output=True` the model's loss becomes
`cross_entropy_1d` over the vocabulary slices (and `model(ids)` returns this rank's padded logit slice).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cx_plugins.models._gpt import GPT, _SelfAttention, attend
from cx_shardformer import (
    FirstCalls,
    FusedLinear1D_Col,
    Linear1D_Col,
    Linear1D_Row,
    ModulePolicyDescription,
    Policy,
    SubModuleReplacementDescription,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    cross_entropy_1d,
)

__all__ = ["GPTPolicy"]


def _check(model: Any, what: str, value: int, tp: int) -> None:
    if value % tp:
        options = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"{type(model).__name__}: {what}={value} is not divisible by the tensor parallel size {tp}; "
            f"sizes that divide it: {options}"
        )


def _sharded_attention_forward(
    self: _SelfAttention, hidden: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference attention on this rank's heads: q/k/v are the three equal thirds of the local fused output."""
    batch, length, _ = hidden.shape
    q, k, v = self.qkv(hidden).chunk(3, dim=-1)
    local_width, heads = q.shape[-1], self.num_heads
    shape = (batch, length, heads, local_width // heads)
    q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
    attended = attend(q, k, v, mask)  # packed documents' mask, broadcast over this rank's heads
    projected: torch.Tensor = self.proj(attended.transpose(1, 2).reshape(batch, length, local_width))
    return projected


class GPTPolicy(Policy):
    """Tensor parallelism for `cx_plugins.models.GPT`. Sequence parallelism and gradient checkpointing raise
    (not implemented for this model); flash attention and fused normalization need nothing (the model already
    runs SDPA and `nn.LayerNorm`)."""

    @property
    def gpt(self) -> GPT:
        if not isinstance(self.model, GPT):
            raise TypeError(f"GPTPolicy shards cx_plugins.models.GPT, got {type(self.model).__name__}")
        return self.model

    def config_sanity_check(self) -> None:
        config, shard = self.gpt.config, self.shard_config
        name = type(self.model).__name__
        if shard.enable_sequence_parallelism:
            raise NotImplementedError(
                f"{name}: sequence parallelism is not implemented for cx's reference GPT; turn it off, or train a "
                "transformers model (e.g. the llama preset)"
            )
        if shard.gradient_checkpoint_config is not None:
            raise NotImplementedError(
                f"{name}: gradient_checkpoint_config is not implemented for cx's reference GPT; leave it None, or "
                "train a transformers model (e.g. the llama preset)"
            )
        if shard.ep_group is not None:
            raise ValueError(f"{name} has no experts; ep_group must be None")
        tp = shard.tensor_parallel_size
        _check(self.model, "num_heads", config.num_heads, tp)
        _check(self.model, "mlp hidden size", config.mlp_ratio * config.hidden_size, tp)

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        if not self.shard_config.enable_tensor_parallelism:
            return {}
        config = self.gpt.config
        width, tp = config.hidden_size, self.shard_config.tensor_parallel_size
        return {
            "_SelfAttention": ModulePolicyDescription(
                attribute_replacement={"num_heads": config.num_heads // tp},
                sub_module_replacement=[
                    SubModuleReplacementDescription("qkv", FusedLinear1D_Col, {"split_sizes": [width] * 3}),
                    SubModuleReplacementDescription("proj", Linear1D_Row),
                ],
                method_replacement={"forward": _sharded_attention_forward},
            ),
            "_Block": ModulePolicyDescription(
                sub_module_replacement=[
                    SubModuleReplacementDescription("mlp.0", Linear1D_Col),
                    SubModuleReplacementDescription("mlp.2", Linear1D_Row),
                ]
            ),
        }

    def postprocess(self) -> nn.Module:
        shard = self.shard_config
        if not shard.enable_tensor_parallelism:
            return self.model
        model, group = self.gpt, shard.tensor_parallel_process_group
        divisible = shard.make_vocab_size_divisible_by
        embedding = VocabParallelEmbedding1D.from_native_module(
            model.embed_tokens,
            group,
            make_vocab_size_divisible_by=divisible,
        )
        setattr(model, "embed_tokens", embedding)  # noqa: B010
        head = VocabParallelLMHead1D.from_native_module(
            model.lm_head,  # a tied head adopts the embedding's shard
            group,
            make_vocab_size_divisible_by=divisible,
            gather_output=not shard.parallel_output,
        )
        setattr(model, "lm_head", head)  # noqa: B010
        if shard.parallel_output:
            vocab_size = model.config.vocab_size
            exact_calls = FirstCalls()  # the first calls name a bad label; later ones assert on the device (issue 37)

            def loss(self: GPT, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
                exact = exact_calls()
                return cross_entropy_1d(logits[:, :-1], labels[:, 1:], -100, group, vocab_size, exact_label_check=exact)

            setattr(model, "loss", loss.__get__(model))  # noqa: B010  (instance override, also used by stages)
        return model
