"""Split transformers decoder-only causal LMs into pipeline stages (transformers imported lazily: the `hf` extra).

`HFDecoderSplitter(model)` implements `PipelineSplittable` for models whose base model follows the structure its
config publishes in `base_model_pp_plan` (`embed_tokens`, `layers`, `norm`) and feeds `inputs_embeds` straight into
the layers: Llama, Mistral, Mixtral, Qwen2/3 and Qwen3-MoE (`SUPPORTED_MODEL_TYPES`). Each stage runs the model's
*own* base forward (masks, rotary embeddings, attention and expert implementations, output capture) on a copy that
holds only its layers: no embedding on later stages (they pass `inputs_embeds`), an identity for the final norm
before the last. The last stage adds the head, the model's own loss function and, for MoE models with
`output_router_logits`, transformers' load-balancing loss over the router logits of *every* layer: earlier stages
send theirs along with the hidden states. GPT-2 (learned positions added after the embedding) has its own stage
module, `GPT2Splitter`.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from cx_pipeline._errors import PipelineConfigError

__all__ = ["GPT2Splitter", "HFDecoderSplitter"]

# Model types whose base forward feeds `inputs_embeds` straight into the layers (checked against transformers 5's
# sources; llama, mixtral and qwen3_moe are tested). Others (e.g. models that scale or add to the embeddings in the
# base forward) would be silently wrong on later stages, so they are refused rather than guessed.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe")


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A module sharing every submodule, parameter and buffer with `module`, whose own registries can be changed."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


def _output_types() -> tuple[type, type]:
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    return CausalLMOutputWithPast, MoeCausalLMOutputWithPast


class _LossParts:
    """What the last stage needs from the causal LM besides its head: loss function and MoE aux-loss settings."""

    def __init__(self, model: Any) -> None:
        config = model.config
        self.vocab_size: int = config.vocab_size
        self.loss_function: Callable[..., torch.Tensor] = model.loss_function
        self.moe = hasattr(config, "output_router_logits") and hasattr(model, "router_aux_loss_coef")
        self.aux: Callable[..., torch.Tensor] | None = None
        if self.moe:
            self.aux = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
            self.num_experts = int(model.num_experts)
            self.top_k = int(model.num_experts_per_tok)
            self.coef = float(model.router_aux_loss_coef)

    def outputs(
        self,
        config: Any,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        router_logits: tuple[torch.Tensor, ...],
    ) -> Any:
        dense, moe_output = _output_types()
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size)
        if not self.moe:
            return dense(loss=loss, logits=logits)
        aux_loss = None
        if config.output_router_logits and self.aux is not None:
            aux_loss = self.aux(router_logits, self.num_experts, self.top_k, attention_mask)
            if loss is not None:
                loss = loss + self.coef * aux_loss.to(loss.device)
        return moe_output(loss=loss, aux_loss=aux_loss, logits=logits, router_logits=router_logits or None)


def check_packed_rows(config: Any, attention_mask: Any, position_ids: Any) -> None:
    """Refuse packed rows (several, positions restarting, no mask) under a flash attention implementation: transformers
    finds packed documents there only in a batch of one row, and would let these attend to each other."""
    implementation = getattr(config, "_attn_implementation", None)
    if not isinstance(implementation, str) or "flash" not in implementation or attention_mask is not None:
        return
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[0] == 1:
        return
    if position_ids.shape[1] > 1 and bool((position_ids.diff(dim=-1) != 1).any()):
        raise PipelineConfigError(
            f"attn_implementation={implementation!r} with restarting position_ids (packed documents) in a micro-batch "
            f"of {position_ids.shape[0]} rows: transformers' flash attention finds packed documents only in one row, "
            "so these would attend to each other; use attn_implementation='sdpa' or micro-batches of one row"
        )


class HFDecoderStage(nn.Module):
    """Layers [start, end) of a transformers causal LM (with embeddings when first, norm and head when last)."""

    def __init__(self, splitter: HFDecoderSplitter, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        base: Any = _shallow_copy(splitter.base)
        base.layers = nn.ModuleList(list(splitter.base.layers)[start:end])
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = nn.Identity()
        self.base: Any = base
        self.lm_head: Any = splitter.lm_head if last else None
        self.first, self.last = first, last
        self._loss = splitter.loss_parts

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        router_logits: tuple[torch.Tensor, ...] = (),
    ) -> Any:
        config = self.base.config
        extra: dict[str, Any] = {}
        collect = self._loss.moe and bool(config.output_router_logits)
        if self._loss.moe:
            extra["output_router_logits"] = collect
        check_packed_rows(config, attention_mask, position_ids)
        if self.first:
            out = self.base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **extra)  # fmt: skip
        else:
            out = self.base(inputs_embeds=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, **extra)  # fmt: skip
        hidden = out.last_hidden_state
        routers = tuple(router_logits) + (tuple(out.router_logits or ()) if collect else ())
        if not self.last:
            sent: dict[str, Any] = {"hidden_states": hidden}
            if collect:
                sent["router_logits"] = routers
            return sent
        assert self.lm_head is not None
        return self._loss.outputs(config, self.lm_head(hidden), labels, attention_mask, routers)


class HFDecoderSplitter:
    """`PipelineSplittable` for a transformers decoder-only causal LM (see the module docstring for which)."""

    def __init__(self, model: Any) -> None:
        config = getattr(model, "config", None)
        plan = getattr(config, "base_model_pp_plan", None) or {}
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        missing = [name for name in ("embed_tokens", "layers", "norm") if name not in plan or not hasattr(base, name)]
        if base is None or missing or not hasattr(model, "lm_head"):
            raise PipelineConfigError(
                f"HFDecoderSplitter cannot split {type(model).__name__}: it needs a causal LM with `lm_head` whose "
                f"base model has embed_tokens / layers / norm (its config's base_model_pp_plan); missing {missing}. "
                "Implement PipelineSplittable for other structures (GPT-2: GPT2Splitter)"
            )
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise PipelineConfigError(
                f"HFDecoderSplitter supports model types {list(SUPPORTED_MODEL_TYPES)} (their base forward feeds "
                f"inputs_embeds straight into the layers), not {model_type!r}: splitting it this way could be silently "
                "wrong on later stages. Implement PipelineSplittable for it (see GPT2Splitter for an example)"
            )
        self.model = model
        self.base: Any = base
        self.lm_head: Any = model.lm_head
        self.loss_parts = _LossParts(model)

    def pipeline_num_layers(self) -> int:
        return len(self.base.layers)

    def pipeline_stage_module(self, start: int, end: int, first: bool, last: bool) -> nn.Module:
        return HFDecoderStage(self, start, end, first, last)


class GPT2Stage(nn.Module):
    """Blocks [start, end) of a transformers GPT2LMHeadModel (token + position embeddings first; ln_f + head last)."""

    def __init__(self, splitter: GPT2Splitter, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        transformer = splitter.transformer
        self.config: Any = transformer.config
        self.wte: Any = transformer.wte if first else None
        self.wpe: Any = transformer.wpe if first else None
        self.drop: Any = transformer.drop if first else None
        self.h = nn.ModuleList(list(transformer.h)[start:end])
        self.ln_f: Any = transformer.ln_f if last else None
        self.lm_head: Any = splitter.lm_head if last else None
        self._loss = splitter.loss_parts

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> Any:
        from transformers.masking_utils import create_causal_mask

        if self.wte is not None:
            assert input_ids is not None
            assert self.wpe is not None
            assert self.drop is not None
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
            hidden = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        else:
            assert hidden_states is not None
            hidden = hidden_states
        if position_ids is None:
            position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=None,
            position_ids=position_ids,
        )  # fmt: skip
        for block in self.h:
            hidden = block(hidden, attention_mask=mask, position_ids=position_ids, use_cache=False)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        if self.lm_head is None:
            return {"hidden_states": hidden}
        assert self.ln_f is not None
        logits = self.lm_head(self.ln_f(hidden))
        return self._loss.outputs(self.config, logits, labels, attention_mask, ())


class GPT2Splitter:
    """`PipelineSplittable` for transformers' GPT2LMHeadModel (tied `wte` / `lm_head` become a shared parameter)."""

    def __init__(self, model: Any) -> None:
        transformer = getattr(model, "transformer", None)
        if transformer is None or not all(hasattr(transformer, n) for n in ("wte", "wpe", "h", "ln_f")):
            raise PipelineConfigError(f"GPT2Splitter needs a GPT2LMHeadModel, got {type(model).__name__}")
        self.transformer: Any = transformer
        self.lm_head: Any = model.lm_head
        self.loss_parts = _LossParts(model)

    def pipeline_num_layers(self) -> int:
        return len(self.transformer.h)

    def pipeline_stage_module(self, start: int, end: int, first: bool, last: bool) -> nn.Module:
        return GPT2Stage(self, start, end, first, last)
