"""Tiny transformers models built from a config (no download) and the checks a sharded model must pass against
its unsharded copy: loss, logits and every gradient, and a few optimizer steps."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardformer_helpers import assert_close, full_grad

VOCAB, SEQ, BATCH = 50, 8, 2


def build(kind: str, **overrides: Any) -> Any:
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        gpt2: dict[str, Any] = {
            "vocab_size": VOCAB,
            "n_positions": 32,
            "n_embd": 16,
            "n_layer": 2,
            "n_head": 4,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
        }
        gpt2.update(overrides)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**gpt2))
    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    }
    if kind == "phi3":
        settings["pad_token_id"] = 0
    if kind.startswith("gemma"):  # tied by default, sqrt(hidden)-scaled embedding; head_dim defaults to 256
        settings["head_dim"] = 4
        settings["tie_word_embeddings"] = True
    settings.update(overrides)
    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    config_class, model_class = classes[kind]
    return model_class(config_class(**settings))


def tokens(step: int = 0, seq: int = SEQ) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, seq), generator=generator)


def full_logits(logits: torch.Tensor, parallel_output: bool, group: Any = None) -> torch.Tensor:
    """Vocabulary-parallel logits gathered and cut to the real vocabulary."""
    if not parallel_output:
        return logits
    pieces = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, logits.contiguous(), group=group)
    return torch.cat(pieces, -1)[..., :VOCAB]


def compare_grads(
    model: nn.Module, reference: nn.Module, what: str, rtol: float = 1e-5, atol: float = 1e-6, group: Any = None
) -> None:
    ref_params = dict(reference.named_parameters())
    names = [name for name, _ in model.named_parameters()]
    assert set(names) == set(ref_params), f"{what}: parameter names differ"
    for name, param in model.named_parameters():
        ref_grad = ref_params[name].grad
        assert ref_grad is not None, f"{what}: reference {name} has no grad"
        assert_close(full_grad(param, group), ref_grad, f"{what}: grad of {name}", rtol, atol)


def compare_state(model: nn.Module, reference: nn.Module, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    state, ref_state = model.state_dict(), reference.state_dict()
    assert set(state) == set(ref_state), f"{what}: state_dict keys differ"
    for name, value in ref_state.items():
        assert state[name].shape == value.shape, f"{what}: {name} is not full-size"
        assert_close(state[name], value, f"{what}: {name}", rtol, atol)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
