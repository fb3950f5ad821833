"""A small GPT-style decoder (tied embeddings, pre-LayerNorm blocks) with deterministic initialisation.

Sized by `GPTConfig`; the defaults make a ~1M-parameter model that trains in seconds on a CPU. Its forward mirrors
Hugging Face causal LMs: `model(input_ids, labels=None, position_ids=None)` returns logits, or the mean next-token
loss when labels are given, so plugins are exercised the way transformers models use them. It also implements
cx-pipeline's `PipelineSplittable` (its blocks are the pipeline's layers), so HybridParallelPlugin can split it into
stages.

Packed documents: `position_ids` that restart at 0 (a window holding several documents, as cx-train packs them) give
each token its position within its document, and attention stops at the restarts (a block-diagonal causal boolean
mask, as transformers builds from restarting position ids). Without restarts (or without position_ids) attention is
SDPA's `is_causal` fast path; deciding so reads one boolean on the host per forward when position_ids are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "document_mask"]


def _positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None, max_positions: int) -> torch.Tensor:
    """The positions to embed: `position_ids` ([B, L] or [L]) or 0..L-1 when None."""
    length = input_ids.shape[1]
    if position_ids is None:
        if length > max_positions:
            raise ValueError(f"sequence length {length} exceeds max_positions {max_positions}")
        return torch.arange(length, device=input_ids.device)
    if position_ids.shape[-1] != length:
        raise ValueError(
            f"position_ids of shape {tuple(position_ids.shape)} do not match input_ids {tuple(input_ids.shape)}"
        )
    return position_ids


def document_mask(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The attention mask of packed documents: None (plain causal attention) without position_ids or when they never
    restart at 0 after a row's first token; else a boolean [B, 1, L, L] mask, True where a query may attend: an
    earlier or the same token of its own document (documents numbered by the count of 0 positions so far)."""
    if position_ids is None:
        return None
    rows = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
    if rows.shape[1] < 2 or not bool((rows[:, 1:] == 0).any()):
        return None
    document = (rows == 0).cumsum(dim=-1)
    length = rows.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=rows.device).tril()
    return (document.unsqueeze(-1) == document.unsqueeze(-2)).unsqueeze(1) & causal


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Causal SDPA, or SDPA with `mask` (a `document_mask`) when there is one."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    max_positions: int = 64
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        for name in ("vocab_size", "max_positions", "hidden_size", "num_layers", "num_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")


class _SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, width = hidden.shape
        q, k, v = self.qkv(hidden).split(width, dim=-1)
        shape = (batch, length, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attended = attend(q, k, v, mask)
        projected: torch.Tensor = self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return projected


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden_size)
        self.attention = _SelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size)
        inner = config.mlp_ratio * config.hidden_size
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, inner), nn.GELU(), nn.Linear(inner, config.hidden_size))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden + self.attention(self.attention_norm(hidden), mask)
        mixed: torch.Tensor = hidden + self.mlp(self.mlp_norm(hidden))
        return mixed


class GPT(nn.Module):
    """Token + position embeddings, `num_layers` blocks, a final LayerNorm and an LM head (tied by default)."""

    def __init__(self, config: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.config = config or GPTConfig()
        c = self.config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_positions = nn.Embedding(c.max_positions, c.hidden_size)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.num_layers))
        self.final_norm = nn.LayerNorm(c.hidden_size)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from its own generator seeded by `seed`: identical on every rank and run."""
        generator = torch.Generator().manual_seed(seed)
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            elif "norm" in name:
                parameter.fill_(1.0)
            else:
                scale = residual_std if name.endswith(("proj.weight", "mlp.2.weight")) else std
                values = torch.randn(parameter.shape, generator=generator) * scale
                parameter.copy_(values.to(parameter.dtype))

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        positions = _positions(input_ids, position_ids, self.config.max_positions)
        mask = document_mask(position_ids)
        hidden = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for block in self.blocks:
            hidden = block(hidden, mask)
        logits: torch.Tensor = self.lm_head(self.final_norm(hidden))
        if labels is None:
            return logits
        return self.loss(logits, labels)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (tensor parallelism swaps in its vocabulary-parallel version)."""
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )

    # ---- cx_pipeline.PipelineSplittable: the blocks are the layers a pipeline distributes ---------------------------
    def pipeline_num_layers(self) -> int:
        return self.config.num_layers

    def pipeline_stage_module(self, start: int, end: int, first: bool, last: bool) -> nn.Module:
        return _GPTStage(self, start, end, first, last)


class _GPTStage(nn.Module):
    """Blocks [start, end) of a GPT, with the embeddings when `first` and the final norm, head and loss when `last`
    (the model's own submodules). Called as `stage(input_ids, labels, hidden_states=...)`; a stage that is not the
    last returns `{"hidden_states": ...}`, the last the loss (logits without labels)."""

    def __init__(self, gpt: GPT, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = gpt.embed_tokens if first else None
        self.embed_positions = gpt.embed_positions if first else None
        self.blocks = nn.ModuleList(list(gpt.blocks)[start:end])
        self.final_norm = gpt.final_norm if last else None
        self.lm_head = gpt.lm_head if last else None
        self.__dict__["gpt"] = gpt  # for its loss; not a submodule (the stage holds only its own layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        gpt: GPT = self.__dict__["gpt"]
        if self.embed_tokens is not None and self.embed_positions is not None:
            positions = _positions(input_ids, position_ids, gpt.config.max_positions)
            hidden = self.embed_tokens(input_ids) + self.embed_positions(positions)
        elif hidden_states is not None:
            hidden = hidden_states
        else:
            raise ValueError("a GPT stage after the first needs the previous stage's hidden_states")
        mask = document_mask(position_ids)
        for block in self.blocks:
            hidden = block(hidden, mask)
        if self.final_norm is None or self.lm_head is None:
            return {"hidden_states": hidden}
        logits: torch.Tensor = self.lm_head(self.final_norm(hidden))
        return logits if labels is None else gpt.loss(logits, labels)
