"""Packed batches for the layout tests: several documents per window, `position_ids` restarting at 0 at each document
and the label of each document's first token -100 (Hugging Face's convention: labels aligned with `input_ids`, the
model shifts them, so the last token of one document never predicts the first of the next), no attention mask.

The reference is transformers on one process, one document at a time: the sum over documents of each document's
summed next-token cross entropy, divided by the number of counted targets (sum of length - 1). That is the token mean
a packed window's loss must equal when attention stops at document boundaries and positions restart.

Tolerance: the packed and per-document runs differ only in reduction order (softmax sums over <= 64 keys with
exactly-zero masked terms, matmuls over width 32-48, the mean over <= 120 targets of losses ~4). fp32 rounding is
u = 6e-8 per operation; a sum of n terms carries at most n*u relative error (n = 120: 7e-6, and ~sqrt(n)*u = 7e-7
in practice); through 2-4 layers of O(1) activations the loss moves by ~1e-6. `LOSS_TOL` = 2e-5 absolute on a loss
of ~4 (5e-6 relative) bounds that with margin while a leak across one boundary moves the loss by ~1e-3 (measured
4.1666 exact vs 4.1648 with the documents attending to each other). Parameters after one SGD step (lr 0.1) carry the
gradient's rounding times lr: `PARAM_TOL` = 1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
LOSS_TOL = 2e-5
PARAM_TOL = 1e-5
# two windows of 32 tokens (divisible by 2 * sp for ring attention's zig-zag split), documents of different lengths;
# window 1's third document straddles ring_attn's chunk boundaries and the sp halves
LENGTHS = ((11, 7, 14), (5, 13, 9, 5))


def documents(seed: int = 1) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (n,), generator=generator) for n in window] for window in LENGTHS]


def packed_batch(docs: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """`input_ids`, `labels` (-100 on each document's first token) and restarting `position_ids`, [windows, S]."""
    ids = torch.stack([torch.cat(window) for window in docs])
    positions = torch.stack([torch.cat([torch.arange(len(doc)) for doc in window]) for window in docs])
    labels = ids.masked_fill(positions == 0, -100)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def counted(docs: list[list[torch.Tensor]]) -> int:
    return sum(len(doc) - 1 for window in docs for doc in window)


def per_document_loss(model: nn.Module, docs: list[list[torch.Tensor]]) -> torch.Tensor:
    """Token mean of next-token cross entropy over `docs`, each run alone through `model` (no packing)."""
    total = torch.zeros(())
    for window in docs:
        for doc in window:
            logits = model(input_ids=doc.unsqueeze(0)).logits[0]
            total = total + F.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")
    return total / counted(docs)


def llama(layers: int = 2) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, num_hidden_layers=layers, attention_dropout=0.0,
    )  # fmt: skip
    assert config.use_cache  # as in most pretrained configs: boosted models must not let it turn packing off
    return transformers.LlamaForCausalLM(config)


def mixtral(layers: int = 2) -> nn.Module:
    """Mixtral without the aux loss (it pools routing over the batch, so a packed batch's differs from the documents'):
    the loss is the cross entropy alone. Top-2 routing is per token, so packing does not change it."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=False, router_jitter_noise=0.0, tie_word_embeddings=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def gpt(layers: int = 4) -> nn.Module:
    """cx's reference GPT sized for the packed windows (32 positions; 4 layers: 2 x 2 chunks for interleaved pp)."""
    from cx_plugins.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=VOCAB, max_positions=32, hidden_size=32, num_layers=layers, num_heads=4)
    return GPT(config, seed=0)


def gpt_per_document_loss(model: nn.Module, docs: list[list[torch.Tensor]]) -> torch.Tensor:
    """`per_document_loss` for cx's GPT (its forward returns the logits)."""
    total = torch.zeros(())
    for window in docs:
        for doc in window:
            logits = model(doc.unsqueeze(0))[0]
            total = total + F.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")
    return total / counted(docs)
