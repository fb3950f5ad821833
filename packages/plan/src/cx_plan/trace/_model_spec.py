"""`ModelShape`: the architecture numbers the planner needs, read from what `cx-train --model` takes (cx's GPT, a
preset name, a Hugging Face model folder) or a bare config.json, plus the model's parameter counts.

The counts come from building the real model on the meta device (no memory), so they are the trained model's own:
dense parameters per decoder layer, routed-expert parameters per layer (and per expert), embeddings and head, and
whether the head is tied. A config.json missing a field the planner needs raises `ModelShapeError` naming every
missing field (transformers would silently fill in its defaults).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cx_plugins.fsdp import decoder_layers
from cx_plugins.models import GPT, GPT_MODEL, PRESETS, GPTConfig, preset_config

__all__ = [
    "shadowed_builtin",
    "TEXT_VOCAB_SIZE",
    "ModelShape",
    "ModelShapeError",
    "ParameterCounts",
    "build_model",
    "is_routed_expert",
    "load_model_shape",
    "train_flags",
]

# (planner field, the config.json names that may hold it): the first present wins
_REQUIRED = (
    ("vocab_size", ("vocab_size",)),
    ("hidden_size", ("hidden_size", "n_embd", "d_model")),
    ("num_hidden_layers", ("num_hidden_layers", "n_layer", "num_layers")),
    ("num_attention_heads", ("num_attention_heads", "n_head", "num_heads")),
)
# The vocabulary of the built-in models as cx-train trains them on its embedded text: the character encoding's 50
# ids (cx-train's tests check the two agree; its --dry-run passes the vocabulary of the run's own tokenizer).
TEXT_VOCAB_SIZE = 50
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


class ModelShapeError(ValueError):
    """A model the planner cannot read, with a message naming what is missing."""


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of the built model (shared ones once)."""

    total: int
    outer: int  # outside the decoder layers: embeddings, final norm, LM head (once when tied)
    embeddings: int  # token and position embeddings plus an untied LM head
    dense_per_layer: tuple[int, ...]  # each decoder layer without its routed experts
    experts_per_layer: tuple[int, ...]  # each decoder layer's routed experts, all of them
    per_expert: int  # one routed expert in one MoE layer (0 for a dense model)
    tied: bool  # the LM head shares the token embedding

    @property
    def experts(self) -> int:
        return sum(self.experts_per_layer)

    @property
    def dense(self) -> int:
        """Everything but the routed experts."""
        return self.total - self.experts


@dataclass(frozen=True)
class ModelShape:
    """One model's architecture numbers and parameter counts; `config` builds it (`build_model`)."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_experts: int  # routed experts per MoE layer; 0 for a dense model
    top_k: int
    max_positions: int
    parameters: ParameterCounts
    config: Any = field(compare=False, repr=False)  # the transformers config, or cx's GPTConfig

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelShapeError("reading a Hugging Face model needs transformers: pip install 'cx-plan[hf]'") from None
    return transformers


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ModelShapeError(f"{path}: cannot read it as JSON: {error}") from None
    if not isinstance(loaded, dict):
        raise ModelShapeError(f"{path}: a model config is a JSON object, got {type(loaded).__name__}")
    return loaded


def _config_from_json(path: Path) -> Any:
    """A transformers config from a config.json, refusing one that lacks a field the planner reads."""
    raw = _read_json(path)
    if isinstance(raw.get("text_config"), dict):  # multimodal wrappers: the language model's config
        raw = {**raw["text_config"], "model_type": raw["text_config"].get("model_type", raw.get("model_type"))}
    missing = [
        " / ".join(names)
        for _, names in _REQUIRED
        if not any(isinstance(raw.get(n), int) and raw[n] > 0 for n in names)
    ]
    if not isinstance(raw.get("model_type"), str):
        missing.insert(0, "model_type")
    if missing:
        raise ModelShapeError(f"{path}: the model config lacks {', '.join(missing)} (each a positive integer)")
    transformers = _transformers()
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return transformers.AutoConfig.for_model(raw["model_type"], **fields)
    except Exception as error:  # transformers' and huggingface_hub's validators raise types of their own
        raise ModelShapeError(f"{path}: transformers rejects this config: {one_line(error)}") from None


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and its message's lines joined (a validator's message spans several)."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _builtin_config(model: str, hidden_size: int, num_layers: int, seq_len: int, vocab_size: int) -> Any:
    """The config cx-train builds for `--model gpt|<preset>` with these sizes: cx's GPT (4 heads) or the preset from
    `cx_plugins.models.preset_config`, the one definition both use, so the planner sees the model that trains."""
    if model == GPT_MODEL:
        return GPTConfig(vocab_size=vocab_size, max_positions=seq_len + 1, hidden_size=hidden_size,
                         num_layers=num_layers, num_heads=4)  # fmt: skip
    try:
        return preset_config(model, vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
                             seq_len=seq_len)  # fmt: skip
    except (ImportError, ValueError) as error:
        raise ModelShapeError(f"--model {model}: {error}") from None


def build_model(shape: ModelShape) -> nn.Module:
    """The model with fresh weights on the current default device (build under `torch.device("meta")` or a
    FakeTensorMode to allocate nothing). A transformers model gets its own copy of the config: the model shares the
    config object it is built from, and ShardFormer's sequence-parallel policy switches its attention implementation
    (Ulysses / ring), which would leak into every later trace of the shape (an AttributeError on `cx_sp_group` in a
    plain candidate's attention)."""
    if isinstance(shape.config, GPTConfig):
        return GPT(shape.config)
    model: nn.Module = _transformers().AutoModelForCausalLM.from_config(copy.deepcopy(shape.config))
    return model


def _decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder layers as per-block FSDP finds them (`cx_plugins.fsdp.decoder_layers`), one per config layer."""
    layers = decoder_layers(model)
    if layers is None or len(layers) != num_layers:
        raise ModelShapeError(f"the model has no list of {num_layers} decoder layers the planner can find")
    return layers


def is_routed_expert(name: str) -> bool:
    """Whether the parameter `name` (dotted, from any module) belongs to a routed experts module."""
    parts = name.split(".")
    return "experts" in parts


def count_parameters(model: nn.Module, num_layers: int, num_experts: int) -> ParameterCounts:
    """Parameter counts by part, shared parameters counted once."""
    layers = _decoder_layers(model, num_layers)
    dense, experts = [], []
    for layer in layers:
        routed = sum(p.numel() for n, p in layer.named_parameters() if num_experts and is_routed_expert(n))
        experts.append(routed)
        dense.append(sum(p.numel() for p in layer.parameters()) - routed)
    total = sum(p.numel() for p in model.parameters())
    in_layers = {id(p) for p in layers.parameters()}
    outer = [(n, p) for n, p in model.named_parameters(remove_duplicate=False) if id(p) not in in_layers]
    seen: set[int] = set()
    tied = False
    embeddings = 0
    for name, parameter in outer:
        if id(parameter) in seen:
            tied = True
            continue
        seen.add(id(parameter))
        if parameter.dim() == 2 and ("emb" in name or "wte" in name or "wpe" in name or "lm_head" in name):
            embeddings += parameter.numel()
    moe_layers = [e for e in experts if e]
    return ParameterCounts(
        total=total,
        outer=sum(p.numel() for p in {id(p): p for _, p in outer}.values()),
        embeddings=embeddings,
        dense_per_layer=tuple(dense),
        experts_per_layer=tuple(experts),
        per_expert=moe_layers[0] // num_experts if moe_layers else 0,
        tied=tied,
    )


def _int(config: Any, names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


def shape_from_config(name: str, config: Any) -> ModelShape:
    """A ModelShape of a transformers config or cx's GPTConfig (the model is built on meta to count)."""
    if isinstance(config, GPTConfig):
        hidden, layers, heads = config.hidden_size, config.num_layers, config.num_heads
        vocab, kv, intermediate, positions = config.vocab_size, heads, config.mlp_ratio * hidden, config.max_positions
        experts, top_k, model_type = 0, 0, GPT_MODEL
    else:
        hidden = _int(config, ("hidden_size", "n_embd"), 0)
        layers = _int(config, ("num_hidden_layers", "n_layer"), 0)
        heads = _int(config, ("num_attention_heads", "n_head"), 0)
        vocab = _int(config, ("vocab_size",), 0)
        missing = [n for n, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                                   ("num_attention_heads", heads), ("vocab_size", vocab)) if not v]  # fmt: skip
        if missing:
            raise ModelShapeError(f"{name}: the model config lacks {', '.join(missing)}")
        kv = _int(config, ("num_key_value_heads",), heads)
        intermediate = _int(config, ("intermediate_size", "n_inner"), 4 * hidden)
        positions = _int(config, ("max_position_embeddings", "n_positions"), 0)
        experts = _int(config, _EXPERT_COUNTS, 0)
        top_k = _int(config, ("num_experts_per_tok",), 1) if experts else 0
        model_type = str(getattr(config, "model_type", "unknown"))
    head_dim = _int(config, ("head_dim",), hidden // heads)
    with torch.device("meta"):
        shape = ModelShape(name, model_type, vocab, hidden, layers, heads, kv, head_dim, intermediate, experts, top_k,
                           positions, ParameterCounts(0, 0, 0, (), (), 0, False), config)  # fmt: skip
        try:
            model = build_model(shape)
        except Exception as error:  # a config transformers accepts but cannot build (an unknown rope type, ...)
            raise ModelShapeError(
                f"{name}: transformers cannot build a model of this config: {one_line(error)}"
            ) from None
        counts = count_parameters(model, layers, experts)
    return ModelShape(name, model_type, vocab, hidden, layers, heads, kv, head_dim, intermediate, experts, top_k,
                      positions, counts, config)  # fmt: skip


def load_model_shape(
    model: str, *, hidden_size: int = 128, num_layers: int = 2, seq_len: int = 64, vocab_size: int = TEXT_VOCAB_SIZE
) -> ModelShape:
    """The shape of `model`: `gpt` or a preset (sized by hidden_size / num_layers / seq_len / vocab_size, as
    cx-train's flags and its text encoding size them), a Hugging Face model folder, or a config.json file (which
    size themselves). An existing path always wins over a built-in name, as a local folder does in transformers'
    `from_pretrained`: `llama` with a folder `llama/` here plans the folder, named `./llama` (so the printed
    cx-train command trains it too); `shadowed_builtin` says when that happened."""
    if shadowed_builtin(model):
        model = f"./{model}"
    if model == GPT_MODEL or model in PRESETS:
        return shape_from_config(model, _builtin_config(model, hidden_size, num_layers, seq_len, vocab_size))
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelShapeError(f"{path}: no config.json in this folder; a Hugging Face model folder has one")
        path = path / "config.json"
    elif not path.is_file():
        raise ModelShapeError(
            f"--model {model}: neither a built-in model ({', '.join((GPT_MODEL, *PRESETS))}), a model folder nor a "
            "config.json file"
        )
    return shape_from_config(model, _config_from_json(path))


def shadowed_builtin(model: str) -> bool:
    """Whether `model` is both a built-in name (gpt, a preset) and an existing path here, which then wins."""
    return (model == GPT_MODEL or model in PRESETS) and Path(model).exists()


def train_flags(shape: ModelShape) -> tuple[str, ...]:
    """The cx-train flags that size this model: `--hidden-size` / `--num-layers` for gpt and the presets (cx-train
    builds their default size otherwise); none for a model folder or config.json, which its config sizes."""
    if shape.name == GPT_MODEL or shape.name in PRESETS:
        return ("--hidden-size", str(shape.hidden_size), "--num-layers", str(shape.num_layers))
    return ()
