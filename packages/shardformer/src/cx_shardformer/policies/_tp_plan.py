"""A generic policy for any transformers model whose config publishes `base_model_tp_plan`.

Entries map module patterns (relative to the base model, `*` matching a layer index) to transformers' styles;
"colwise" becomes `Linear1D_Col` and "rowwise" `Linear1D_Row`, so a new architecture gets tensor parallelism with no
hand-written policy as long as its attention reshapes with -1 heads (transformers 5 does, for its own TP). The LM
head, when the model has one, becomes a `VocabParallelLMHead1D`. Other styles raise a clear error naming them.
"""

from __future__ import annotations

import re

from torch import nn

from cx_shardformer._linear import Linear1D_Col, Linear1D_Row
from cx_shardformer._policy import ModulePolicyDescription
from cx_shardformer._sharder import set_submodule
from cx_shardformer.policies._common import HFDecoderPolicy, check_divisible

__all__ = ["TPPlanPolicy"]

_STYLES: dict[str, type[Linear1D_Col] | type[Linear1D_Row]] = {"colwise": Linear1D_Col, "rowwise": Linear1D_Row}


def _pattern(plan_key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(plan_key).replace(r"\*", r"\d+") + "$")


class TPPlanPolicy(HFDecoderPolicy):
    """Tensor parallelism from `config.base_model_tp_plan` (colwise / rowwise entries)."""

    lm_head_path = "lm_head"

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

    def config_sanity_check(self) -> None:
        if self.shard_config.enable_sequence_parallelism:
            raise NotImplementedError(
                f"{type(self.model).__name__}: the generic tp-plan policy does not do sequence parallelism; "
                "use a checked policy (Llama, GPT-2)"
            )
        unsupported = sorted({style for style in self.plan().values() if style not in _STYLES})
        if unsupported and self.shard_config.enable_tensor_parallelism:
            raise NotImplementedError(
                f"{type(self.model).__name__}: base_model_tp_plan styles {unsupported} are not supported by the "
                f"generic policy (supported: {sorted(_STYLES)}); write a Policy for this model"
            )
        config = self.hf_config
        if self.shard_config.enable_tensor_parallelism:
            for name in ("num_attention_heads", "num_key_value_heads"):
                value = getattr(config, name, None)
                if isinstance(value, int):
                    check_divisible(self.model, name, value, self.tp_size)

    def module_policy(self) -> dict[type[nn.Module] | str, ModulePolicyDescription]:
        return {}  # replacements are by path, in postprocess

    def postprocess(self) -> nn.Module:
        if not self.shard_config.enable_tensor_parallelism:
            self.apply_switches()
            return self.model
        prefix = self._base_prefix()
        patterns = [(_pattern(prefix + key), _STYLES[style]) for key, style in self.plan().items()]
        group = self.shard_config.tensor_parallel_process_group
        for name, module in list(self.model.named_modules()):
            for pattern, layer in patterns:
                if pattern.match(name):
                    if not isinstance(module, nn.Linear):
                        raise TypeError(
                            f"{type(self.model).__name__}: tp plan entry matches {name!r}, a "
                            f"{type(module).__name__}, not an nn.Linear"
                        )
                    set_submodule(self.model, name, layer.from_native_module(module, group))
                    break
        if self.has_lm_head():
            self.embedding_path = ""  # the plan leaves embeddings replicated; only the head is vocabulary-parallel
            self.shard_vocab()
        self.apply_switches()
        return self.model

    def decoder_layers(self) -> list[nn.Module]:
        base = getattr(self.model, "base_model", self.model)
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList):
            raise TypeError(f"{type(self.model).__name__}: no `layers` list on the base model")
        return list(layers)
