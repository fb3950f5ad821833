"""Vocabulary-parallel embedding and LM head: the vocabulary rows are split over the tensor-parallel group.

The vocabulary is padded up to a multiple of `make_vocab_size_divisible_by * tp` so it always splits evenly; the
padding rows are zeros that live only in the local shards (never in `state_dict()`), receive no gradient (the
embedding never looks them up; the LM head's padded logits are cut off or masked by `cross_entropy_1d`). An input id
outside the vocabulary raises (as `F.embedding` does) instead of becoming a zero embedding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh import ProcessGroup
from cx_shardformer._comm import group_rank, group_size, reduce_forward
from cx_shardformer._ids import FirstCalls, check_ids_in_vocabulary
from cx_shardformer._linear import _ColumnBase
from cx_shardformer._parallel_module import ParallelModule
from cx_shardformer._shard_spec import make_spec, shard_parameter_

__all__ = ["VocabParallelEmbedding1D", "VocabParallelLMHead1D", "padded_vocab_size"]


def padded_vocab_size(num_embeddings: int, make_vocab_size_divisible_by: int, world: int) -> int:
    """`num_embeddings` rounded up to a multiple of `make_vocab_size_divisible_by * world`."""
    if make_vocab_size_divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by must be >= 1, got {make_vocab_size_divisible_by}")
    multiple = make_vocab_size_divisible_by * world
    return -(-num_embeddings // multiple) * multiple


def _embed_scale(module: nn.Embedding) -> torch.Tensor | float | None:
    """The `embed_scale` of transformers' `*ScaledWordEmbedding` (Gemma, BART, ...: the lookup times a constant),
    None for a plain `nn.Embedding`. Any other subclass that changes `forward` is refused: its computation would be
    lost when the module is replaced."""
    if type(module).forward is nn.Embedding.forward:
        return None
    scale = getattr(module, "embed_scale", None)
    if type(module).__name__.endswith("ScaledWordEmbedding") and isinstance(scale, torch.Tensor | float):
        return scale
    raise TypeError(
        f"VocabParallelEmbedding1D: {type(module).__name__} overrides nn.Embedding.forward; only a plain nn.Embedding "
        "or transformers' *ScaledWordEmbedding (lookup times embed_scale) can be made vocabulary-parallel"
    )


class VocabParallelEmbedding1D(ParallelModule):
    """`nn.Embedding` with its rows split over `process_group`: each rank looks up the ids it owns, zeros the others,
    and the partial embeddings are summed (all-reduce; in fp8 with `fp8_communication`). `embed_scale` (a tensor,
    kept as a non-persistent buffer as transformers keeps it, or a float) multiplies the result, for transformers'
    scaled word embeddings."""

    embed_scale: torch.Tensor | float | None

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
        weight: torch.Tensor | None = None,
        make_vocab_size_divisible_by: int = 64,
        embed_scale: torch.Tensor | float | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.process_group = process_group
        self._exact_id_check = FirstCalls()  # the first forwards name a bad id; later ones assert on the device
        world = group_size(process_group)
        self.num_embeddings_padded = padded_vocab_size(num_embeddings, make_vocab_size_divisible_by, world)
        self.num_embeddings_per_partition = self.num_embeddings_padded // world
        self.vocab_start_index = group_rank(process_group) * self.num_embeddings_per_partition
        if weight is None:
            weight = nn.Embedding(num_embeddings, embedding_dim, padding_idx, dtype=dtype, device=device).weight
        spec = make_spec(0, (num_embeddings,), world, self.num_embeddings_padded, type(self).__name__)
        self.weight = shard_parameter_(weight, spec, process_group)
        if isinstance(embed_scale, torch.Tensor):
            self.register_buffer("embed_scale", embed_scale, persistent=False)
        else:
            self.embed_scale = embed_scale

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None = None, **kwargs: Any
    ) -> VocabParallelEmbedding1D:
        """Shard an `nn.Embedding` (or a transformers scaled word embedding) in place: the same Parameter holds this
        rank's rows."""
        if not isinstance(module, nn.Embedding):
            raise TypeError(f"{cls.__name__}.from_native_module expects an nn.Embedding, got {type(module).__name__}")
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{cls.__name__}: max_norm, sparse and scale_grad_by_freq are not supported")
        return cls(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            process_group=process_group,
            weight=module.weight,
            embed_scale=_embed_scale(module),
            **kwargs,
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        exact = self._exact_id_check()
        check_ids_in_vocabulary(input_, self.num_embeddings, type(self).__name__, "input id", exact=exact)
        start, count = self.vocab_start_index, self.num_embeddings_per_partition
        outside = (input_ < start) | (input_ >= start + count)
        local_ids = (input_ - start).masked_fill(outside, 0)
        padding = None
        if self.padding_idx is not None and start <= self.padding_idx < start + count:
            padding = self.padding_idx - start
        out = F.embedding(local_ids, self.weight, padding)
        # fp8_communication (set by `_fp8_switches.apply_fp8`): the partial embeddings' sum travels as fp8, as
        # ColossalAI's VocabParallelEmbedding1D sends it
        partial = out.masked_fill(outside.unsqueeze(-1), 0.0)
        out = reduce_forward(partial, self.process_group, self.fp8_communication)
        scale = self.embed_scale
        if isinstance(scale, torch.Tensor):
            return out * scale.to(self.weight.dtype)  # as transformers scales: in the weight's dtype
        return out if scale is None else out * scale

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padded={self.num_embeddings_padded}, "
            f"tp={group_size(self.process_group)}"
        )


class VocabParallelLMHead1D(_ColumnBase):
    """The LM head as a column-parallel linear over the (padded) vocabulary. `gather_output=True` returns the full
    logits with the padding cut off; otherwise each rank returns its vocabulary slice (padded columns included),
    for `cross_entropy_1d(..., vocab_size=num_embeddings)`. Sharing its weight with a `VocabParallelEmbedding1D`
    (tied embeddings) is supported: the weight is sharded once."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        process_group: ProcessGroup | None = None,
        weight: torch.Tensor | None = None,
        bias_: torch.Tensor | None = None,
        make_vocab_size_divisible_by: int = 64,
        gather_output: bool = False,
        seq_parallel_mode: str | None = None,
        seq_parallel_dim: int = 1,
    ) -> None:
        if weight is None:
            plain = nn.Linear(in_features, out_features, bias=bias, dtype=dtype, device=device)
            weight, bias_ = plain.weight, plain.bias
        world = group_size(process_group)
        padded = padded_vocab_size(out_features, make_vocab_size_divisible_by, world)
        super().__init__(
            in_features,
            out_features,
            weight,
            bias_ if bias else None,
            process_group,
            gather_output,
            seq_parallel_mode,
            seq_parallel_dim,
            False,
            None,
            padded,
        )
        self.num_embeddings = out_features
        self.num_embeddings_padded = padded

    @classmethod
    def from_native_module(
        cls, module: nn.Module, process_group: ProcessGroup | None = None, **kwargs: Any
    ) -> VocabParallelLMHead1D:
        """Shard an `nn.Linear` LM head in place (a weight tied to a sharded embedding is adopted as it is)."""
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_native_module expects an nn.Linear, got {type(module).__name__}")
        return cls(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            process_group=process_group,
            weight=module.weight,
            bias_=module.bias,
            **kwargs,
        )
