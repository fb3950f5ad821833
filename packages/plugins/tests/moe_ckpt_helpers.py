"""Shared pieces of the MoeHybridParallelPlugin checkpoint tests (`test_plugins_moe_checkpoint*.py`): tiny HF
Mixtral / Qwen3-MoE / DeepSeek-V3 models (fp32, aux loss on), the training rows, the
tolerances, and `check_saved`, which compares a saved folder with a single-process reference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cx_checkpoint import CheckpointKind, CheckpointReader, optimizer_tensor_name
from cx_mesh.testing import tiny_model_adam_tolerance

VOCAB, ROWS, LENGTH, LR = 50, 4, 8, 1e-2
# AdamW at TEST_ADAM_EPS: layouts differ by rounding alone, bounded for the tests' runs of up to 6 steps
RTOL, ATOL = 1e-4, tiny_model_adam_tolerance(LR, steps=6, tokens=ROWS * LENGTH)
TIMEOUT = 300.0  # seconds per distributed phase: four ranks on a shared two-core machine can take minutes to start

transformers = pytest.importorskip("transformers")


def mixtral(experts: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=experts, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.05, router_jitter_noise=0.0, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


def qwen3_moe() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=32, num_experts=4,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.Qwen3MoeForCausalLM(config)
    return model


def deepseek_v3() -> nn.Module:
    """A dense first layer, then MoE layers with a shared expert and the sigmoid router's correction bias buffer."""
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, tie_word_embeddings=False,
        use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.DeepseekV3ForCausalLM(config)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {"mixtral": mixtral, "qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}
LOADERS: dict[str, Any] = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def rows(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(100 + step))


def check_saved(model: str, folder: Path, expected: dict[str, Any]) -> None:
    """`from_pretrained` of the saved model folder (sharded safetensors + index) against the reference parameters,
    and the saved Adam moments (full expert stacks by name) against the reference optimizer's."""
    assert (folder / "model" / "model.safetensors.index.json").is_file(), sorted((folder / "model").iterdir())
    loaded, info = getattr(transformers, LOADERS[model]).from_pretrained(
        folder / "model", local_files_only=True, output_loading_info=True
    )
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), info
    params = dict(loaded.named_parameters())
    assert sorted(params) == sorted(expected["params"])
    for name, value in expected["params"].items():
        torch.testing.assert_close(params[name].detach(), value, rtol=RTOL, atol=ATOL, msg=f"{folder}: {name}")
    fused = [n for n in params if n.endswith(FUSED_EXPERTS)]
    assert fused, "the experts are saved under transformers' fused names"
    assert all(params[n].shape[0] == 4 for n in fused), "full expert stacks under the HF names"
    with CheckpointReader.open(folder / "optimizer", CheckpointKind.OPTIMIZER) as reader:
        for name, entries in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                saved = reader.read(optimizer_tensor_name(name, key))
                torch.testing.assert_close(
                    saved, entries[key], rtol=RTOL, atol=1e-7, msg=f"{folder}: state of {name}.{key}"
                )
