"""What the fp8 plugin tests (DDP, FSDP) share: a tiny HF Llama (hidden 32, 2 layers, every projection's dims
multiples of 16) and four fixed global batches cycled over the steps, so the model can learn them and the loss
really falls."""

from __future__ import annotations

import torch
from torch import nn

VOCAB, PER_RANK, LENGTH, BATCHES = 64, 2, 16, 4


def tiny_llama() -> nn.Module:
    """The model, seeded: every call (and every rank) builds the same weights."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=LENGTH, num_hidden_layers=2, use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def cycled_batch(step: int, rank: int) -> torch.Tensor:
    """This rank's PER_RANK rows of global batch `step % BATCHES` (2 ranks)."""
    ids = torch.randint(0, VOCAB, (2 * PER_RANK, LENGTH), generator=torch.Generator().manual_seed(step % BATCHES))
    return ids[rank * PER_RANK : (rank + 1) * PER_RANK]
