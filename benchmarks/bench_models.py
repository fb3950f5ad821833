"""The tiny Hugging Face Llama the tensor/pipeline benchmarks train, built one way for all of them.

Seeded (every rank and every system gets the same weights), untied embeddings (like Llama's real checkpoints, and
so the TP plans split the head on its own), no KV cache, sdpa attention (transformers 5's default, stated so each
benchmark says what it runs). Scripts import it after putting benchmarks/ on `sys.path`.
"""

from __future__ import annotations

from typing import Any

import torch


def tiny_llama(
    *, layers: int, hidden: int, intermediate: int, vocab: int, seq: int, heads: int = 8, kv_heads: int = 4
) -> Any:
    """`transformers.LlamaForCausalLM` of that shape, initialised from seed 0 (transformers imported lazily)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)
