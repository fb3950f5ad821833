"""The tiny Hugging Face presets: a small but real config of each architecture family cx trains (GPT-2, Llama,
Mixtral, Qwen3-MoE, DeepSeek-V3), built from a few sizes with no download. cx-train trains them (`--model llama`)
and cx-plan plans them, from this one definition, so the planner sees the model that trains.

transformers is imported only here, when a preset is asked for.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from cx_plugins.models._names import PRESETS

__all__ = ["preset_config"]


def _transformers(name: str) -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"the {name} preset is a Hugging Face transformers model, which is not installed: "
            "pip install 'cx-plugins[hf]' (or pip install 'transformers>=5')"
        ) from None
    return transformers


def preset_config(name: str, *, vocab_size: int, hidden_size: int, num_layers: int, seq_len: int) -> Any:
    """The transformers config of preset `name` (one of `PRESETS`): 4 attention heads, positions for `seq_len`
    tokens plus one, and for the MoE families 4 experts with top-2 routing and the aux loss on (a pipeline reads it
    from the config, not from a forward argument). Raises ValueError for an unknown name, ImportError without
    transformers."""
    if name not in PRESETS:
        raise ValueError(f"{name!r} is not a preset ({', '.join(PRESETS)})")
    transformers = _transformers(name)
    hidden, layers, positions = hidden_size, num_layers, seq_len + 1
    head_dim = hidden // 4
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=positions,
        intermediate_size=2 * hidden,
        use_cache=False,
    )
    experts: dict[str, Any] = dict(num_experts_per_tok=2, output_router_logits=True)
    if name == "gpt2":
        no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2Config(
            vocab_size=vocab_size, n_positions=positions, n_embd=hidden, n_layer=layers, n_head=4,
            use_cache=False, **no_dropout,
        )  # fmt: skip
    if name == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=2)
    if name == "mixtral":
        return transformers.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4, **experts)
    if name == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, num_key_value_heads=2, head_dim=head_dim, num_experts=4, moe_intermediate_size=hidden, **experts
        )
    # deepseek_v3: one dense layer first, then MoE layers with a shared expert
    return transformers.DeepseekV3Config(
        **common, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1, moe_intermediate_size=hidden,
        first_k_dense_replace=min(1, layers - 1), n_group=1, topk_group=1, q_lora_rank=None,
        kv_lora_rank=hidden // 2, qk_rope_head_dim=head_dim, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
        **experts,
    )  # fmt: skip
