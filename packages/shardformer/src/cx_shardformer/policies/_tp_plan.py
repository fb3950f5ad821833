"""A generic policy for any transformers model whose config publishes `base_model_tp_plan`.

Entries map module patterns (relative to the base model, `*` matching a layer index) to transformers' styles:

| style | cx layer |
|---|---|
| `colwise` | `Linear1D_Col` |
| `rowwise` | `Linear1D_Row` |
| `colwise_gather_output` | `Linear1D_Col(gather_output=True)` (the model slices or normalises the full output) |
| `rowwise_split_input` | `Linear1D_Row(parallel_input=False)` (its input is replicated) |
| `replicated_with_grad_allreduce` | parameters stay whole; gradients summed over tp (e.g. Qwen3's per-head q/k norms) |

So a new architecture gets tensor parallelism with no hand-written policy, as long as its attention reshapes with
-1 heads (transformers 5 models do, for transformers' own TP). The LM head, when there is one, becomes a
`VocabParallelLMHead1D`; the embedding stays replicated unless the head is tied to it (Gemma, Qwen3 with
`tie_word_embeddings`), when it becomes a `VocabParallelEmbedding1D` over the same shard. Sequence parallelism works
for decoders laid out as transformers 5 lays them out (`layers` with `self_attn` and `mlp`, a final `norm`, rotary
tables passed as `position_embeddings`). Other styles raise a clear error naming them.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from cx_shardformer._linear import Linear1D_Col, Linear1D_Row, sync_grad_over
from cx_shardformer._policy import ModulePolicyDescription
from cx_shardformer._sharder import get_submodule_or_none, set_submodule
from cx_shardformer.policies._common import HFDecoderPolicy, check_divisible
from cx_shardformer.policies._sequence import apply_sequence_parallelism, check_sequence_parallelism

__all__ = ["TPPlanPolicy"]

_LAYERS: dict[str, tuple[type[Linear1D_Col] | type[Linear1D_Row], dict[str, Any]]] = {
    "colwise": (Linear1D_Col, {}),
    "rowwise": (Linear1D_Row, {}),
    "colwise_gather_output": (Linear1D_Col, {"gather_output": True}),
    "rowwise_split_input": (Linear1D_Row, {"parallel_input": False}),
}
_REPLICATED = "replicated_with_grad_allreduce"
_SUPPORTED = sorted([*_LAYERS, _REPLICATED])


def _pattern(plan_key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(plan_key).replace(r"\*", r"\d+") + "$")


class TPPlanPolicy(HFDecoderPolicy):
    """Tensor (and sequence) parallelism from `config.base_model_tp_plan`."""

    lm_head_path = "lm_head"
    shares_block_reductions = False  # unknown block structure: each column layer reduces its own input gradient

    def plan(self) -> dict[str, str]:
        plan = getattr(self.hf_config, "base_model_tp_plan", None)
        if not plan:
            raise TypeError(f"{type(self.model).__name__}: its config publishes no base_model_tp_plan; write a Policy")
        return dict(plan)

    def _base_prefix(self) -> str:
        base = getattr(self.model, "base_model", self.model)
        for name, module in self.model.named_modules():
            if module is base:
                return f"{name}." if name else ""
        return ""

    def set_model(self, model: nn.Module) -> None:
        super().set_model(model)
        prefix = self._base_prefix()
        self.embedding_path = f"{prefix}embed_tokens"
        self.layers_path = f"{prefix}layers"
        self.norm_path = f"{prefix}norm"

    def config_sanity_check(self) -> None:
        self.reject_expert_parallelism()
        unsupported = sorted({style for style in self.plan().values() if style not in _SUPPORTED})
        if unsupported and self.shard_config.enable_tensor_parallelism:
            raise NotImplementedError(
                f"{type(self.model).__name__}: base_model_tp_plan styles {unsupported} are not supported by the "
                f"generic policy (supported: {_SUPPORTED}); write a Policy for this model"
            )
        config = self.hf_config
        if self.shard_config.enable_tensor_parallelism:
            for name in ("num_attention_heads", "num_key_value_heads"):
                value = getattr(config, name, None)
                if isinstance(value, int):
                    check_divisible(self.model, name, value, self.tp_size)
        if self.shard_config.enable_sequence_parallelism:
            layers = get_submodule_or_none(self.model, self.layers_path)
            norm = get_submodule_or_none(self.model, self.norm_path)
            if not isinstance(layers, nn.ModuleList) or norm is None:
                raise NotImplementedError(
                    f"{type(self.model).__name__}: the generic policy does sequence parallelism for decoders with "
                    f"`{self.layers_path}` and `{self.norm_path}`; this model has another layout, write a Policy"
                )
        check_sequence_parallelism(self)

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        return {}  # replacements are by path, in postprocess

    def postprocess(self) -> nn.Module:
        if self.shard_config.enable_tensor_parallelism:
            self._shard_plan()
            if self.has_lm_head():
                self._shard_head()
        apply_sequence_parallelism(self)
        self.share_input_reduction()
        self.apply_switches()
        return self.model

    def _shard_head(self) -> None:
        """The LM head vocabulary-parallel; the plan leaves an untied embedding replicated. A tied head's weight is
        the embedding's, so sharding it shards the embedding too: the embedding then becomes vocabulary-parallel
        (a plain lookup into a vocabulary shard reads the wrong rows). A head tied to anything else is refused."""
        head_weight = getattr(get_submodule_or_none(self.model, self.lm_head_path), "weight", None)
        own, embedding = f"{self.lm_head_path}.weight", f"{self.embedding_path}.weight"
        ties = [
            name
            for name, param in self.model.named_parameters(remove_duplicate=False)
            if param is head_weight and name != own
        ]
        plain_embedding = isinstance(get_submodule_or_none(self.model, self.embedding_path), nn.Embedding)
        unshardable = [name for name in ties if name != embedding or not plain_embedding]
        if unshardable:
            raise NotImplementedError(
                f"{type(self.model).__name__}: the LM head's weight is tied to {unshardable}; the generic policy makes "
                f"a head tied to the embedding `{embedding}` vocabulary-parallel, not other ties; untie them or "
                "write a Policy"
            )
        if ties:
            self.shard_vocab()
            return
        embedding_path = self.embedding_path
        self.embedding_path = ""  # untied: only the head is vocabulary-parallel
        self.shard_vocab()
        self.embedding_path = embedding_path

    def _shard_plan(self) -> None:
        prefix = self._base_prefix()
        patterns = [(_pattern(prefix + key), style) for key, style in self.plan().items()]
        config = self.shard_config
        group = config.tensor_parallel_process_group
        split_gather = config.sequence_parallelism_mode == "split_gather" and config.enable_sequence_parallelism
        for name, module in list(self.model.named_modules()):
            style = next((style for pattern, style in patterns if pattern.match(name)), None)
            if style is None:
                continue
            if style == _REPLICATED:
                for param in module.parameters():
                    sync_grad_over(param, group)
                continue
            if not isinstance(module, nn.Linear):
                raise TypeError(
                    f"{type(self.model).__name__}: tp plan entry {style!r} matches {name!r}, a "
                    f"{type(module).__name__}, not an nn.Linear"
                )
            layer, kwargs = _LAYERS[style]
            if split_gather and layer is Linear1D_Row:
                kwargs = {**kwargs, "seq_parallel_mode": "split_gather"}
            set_submodule(self.model, name, layer.from_native_module(module, group, **kwargs))
