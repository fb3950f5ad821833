"""Hugging Face models (built from a config, no download) train under Gemini exactly like PyTorch: GPT-2 with a tied
LM head and Llama (RMSNorm, rotary buffers, untied head). fp32, world 2, 1e-5 relative. Skips without transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import VOCAB, Reference, assert_state_close, train_step

transformers = pytest.importorskip("transformers")


class Logits(nn.Module):
    """Returns the logits tensor of a Hugging Face causal LM (the reference helpers expect a tensor)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.model(input_ids=tokens).logits
        return logits


def _hf(kind: str) -> Logits:
    torch.manual_seed(0)
    if kind == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_positions=16,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return Logits(transformers.GPT2LMHeadModel(config))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=False,
    )
    return Logits(transformers.LlamaForCausalLM(config))


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@distributed(world_size=2)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_zero_gemini_transformers_match_reference(rank: int, world_size: int, kind: str) -> None:
    reference = Reference(_hf(kind), world_size, _adamw)
    ddp = GeminiDDP(_hf(kind), chunk_config_dict={"chunk_size": 1024}, mixed_precision=torch.float32)
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(3):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), 1e-5, 1e-6, f"{kind} step {step}")
