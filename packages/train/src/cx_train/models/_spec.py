"""cx-train's models: cx's reference GPT, a tiny transformers architecture built from a preset config (no download),
or a local transformers model folder (`from_pretrained` on that path only, its tokenizer when it has one).

transformers is imported only for the last two, so the default run needs nothing beyond cx. Every question the
training loop asks of an HF model (its loss, whether it routes tokens to experts) goes through the config or the
model's standard outputs: there is no model-specific code past the preset configs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from cx_plugins.models import GPT, GPT_MODEL, MODEL_CHOICES, PRESETS, GPTConfig, preset_config
from cx_train.data._grammar import CharTokenizer, TextEncoder
from cx_train.data._tokenizers import ByteTokenizer
from cx_train.models._special_tokens import special_token_ids, write_special_tokens

__all__ = [
    "GPT_MODEL",
    "MODEL_CHOICES",
    "PRESETS",
    "DescribedModel",
    "ModelError",
    "ModelSpec",
    "build_model",
    "check_builds",
    "describe_model",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts")


class ModelError(ValueError):
    """A `--model` that cannot be used, with a message meant for the command line."""


@dataclass(frozen=True)
class ModelSpec:
    """What `--model` names plus the sizes the built-in models take from the other flags."""

    model: str
    hidden_size: int
    num_layers: int
    seq_len: int
    own_data: bool = False  # --data: the built-in models (and a folder without a tokenizer) read UTF-8 bytes

    @property
    def is_folder(self) -> bool:
        return self.model not in MODEL_CHOICES

    @property
    def is_hf(self) -> bool:
        return self.model != GPT_MODEL

    @property
    def is_config_file(self) -> bool:
        """`--model path/to/config.json`: a transformers config alone, trained from fresh weights."""
        return self.is_folder and Path(self.model).is_file()


@dataclass(frozen=True)
class DescribedModel:
    """A described (not yet built) model: its HF config (None for the GPT), the text encoder, its shape facts."""

    spec: ModelSpec
    config: Any
    tokenizer: TextEncoder
    num_layers: int
    num_heads: int
    num_kv_heads: int
    num_experts: int  # 0 for a dense model
    top_k: int


def _transformers(spec: ModelSpec) -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise ModelError(
            f"--model {spec.model} needs Hugging Face transformers, which is not installed: "
            "pip install 'cx-train[hf]' (or pip install 'transformers>=5')"
        ) from None
    return transformers


def _preset_config(spec: ModelSpec, vocab_size: int) -> Any:
    """The preset's tiny config (`cx_plugins.models.preset_config`, which cx-plan plans from too)."""
    _transformers(spec)  # the install hint for --model when transformers is missing
    try:
        return preset_config(spec.model, vocab_size=vocab_size, hidden_size=spec.hidden_size,
                             num_layers=spec.num_layers, seq_len=spec.seq_len)  # fmt: skip
    except ValueError as error:
        raise ModelError(f"--model {spec.model}: {error}") from None


class _HFTokenizer:
    """A model folder's own tokenizer, as a `TextEncoder`."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    @property
    def hf_tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def encode(self, text: str) -> torch.Tensor:
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)


def _file_config(spec: ModelSpec) -> tuple[Any, TextEncoder]:
    """A bare config.json (any file name, as cx-plan takes): the architecture only, no weights or tokenizer."""
    transformers = _transformers(spec)
    try:
        config = transformers.AutoConfig.from_pretrained(spec.model, local_files_only=True)
    except Exception as error:  # transformers' and huggingface_hub's validators raise types of their own
        raise ModelError(
            f"--model {spec.model}: transformers cannot read it as a model config: {one_line(error)}"
        ) from None
    return config, ByteTokenizer() if spec.own_data else CharTokenizer()


def _folder_config(spec: ModelSpec) -> tuple[Any, TextEncoder]:
    if spec.is_config_file:
        return _file_config(spec)
    folder = Path(spec.model)
    if not folder.is_dir():
        raise ModelError(
            f"--model {spec.model}: neither a built-in model ({', '.join(MODEL_CHOICES)}), a model folder nor a "
            "config.json file"
        )
    if not (folder / "config.json").is_file():
        raise ModelError(f"--model {folder}: no config.json there; a transformers model folder needs one")
    transformers = _transformers(spec)
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # as above
        raise ModelError(f"--model {folder}: transformers cannot read its config.json: {one_line(error)}") from None
    tokenizer: TextEncoder = ByteTokenizer() if spec.own_data else CharTokenizer()
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        try:
            tokenizer = _HFTokenizer(transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True))
        except Exception as error:  # as above
            raise ModelError(f"--model {folder}: transformers cannot load its tokenizer: {one_line(error)}") from None
    return config, tokenizer


def one_line(error: BaseException) -> str:
    """An exception as one line: its type and its message's lines joined (a validator's message spans several)."""
    message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def check_builds(described: DescribedModel) -> None:
    """Build the model's architecture on the meta device (no memory, no weights read), before any process starts:
    a config transformers accepts but cannot build (an unknown rope type, ...) fails here with one line, not in
    every rank's traceback."""
    if described.config is None:  # cx's GPT: its config was checked when it was made
        return
    transformers = _transformers(described.spec)
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(copy.deepcopy(described.config))
    except Exception as error:  # whatever the model's constructor raises
        raise ModelError(
            f"--model {described.spec.model}: transformers cannot build a model of this config: {one_line(error)}"
        ) from None


def _first_int(config: Any, names: tuple[str, ...], default: int) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return default


def describe_model(spec: ModelSpec) -> DescribedModel:
    """Resolve `--model` to a config and a tokenizer and check they fit the data (raises `ModelError`)."""
    if not spec.is_hf:
        config = None
        tokenizer: TextEncoder = ByteTokenizer() if spec.own_data else CharTokenizer()
        return DescribedModel(spec, None, tokenizer, spec.num_layers, 4, 4, 0, 0)
    if spec.is_folder:
        config, tokenizer = _folder_config(spec)
    else:
        tokenizer = ByteTokenizer() if spec.own_data else CharTokenizer()
        config = _preset_config(spec, tokenizer.vocab_size)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < tokenizer.vocab_size:
        source = "its tokenizer" if isinstance(tokenizer, _HFTokenizer) else "the built-in character encoding"
        raise ModelError(
            f"--model {spec.model}: the model's vocab_size {vocab} is smaller than the {tokenizer.vocab_size} "
            f"token ids {source} produces; token ids past the embedding would fail"
        )
    positions = _first_int(config, ("max_position_embeddings", "n_positions"), 0)
    if positions and positions < spec.seq_len + 1:
        raise ModelError(
            f"--seq-len {spec.seq_len}: the model takes at most {positions} positions; use --seq-len {positions - 1}"
            " or less"
        )
    heads = _first_int(config, ("num_attention_heads",), 1)
    return DescribedModel(
        spec=spec,
        config=config,
        tokenizer=tokenizer,
        num_layers=_first_int(config, ("num_hidden_layers",), 1),
        num_heads=heads,
        num_kv_heads=_first_int(config, ("num_key_value_heads",), heads),
        num_experts=_first_int(config, _EXPERT_COUNT_NAMES, 0),
        top_k=_first_int(config, ("num_experts_per_tok",), 1),
    )


def _with_special_tokens(model: nn.Module, tokenizer: TextEncoder, keep_unknown: bool) -> nn.Module:
    """The tokenizer's bos / eos / pad ids in the model's config and generation config (what a save writes)."""
    ids = special_token_ids(tokenizer)
    for target in (getattr(model, "config", None), getattr(model, "generation_config", None)):
        if target is not None:
            write_special_tokens(target, ids, keep_unknown)
    return model


def build_model(described: DescribedModel, seed: int) -> nn.Module:
    """The model itself: seeded fresh weights for the GPT, the presets and a bare config file, the folder's weights
    (fp32) otherwise."""
    spec = described.spec
    if not spec.is_hf:
        gpt_config = GPTConfig(
            vocab_size=described.tokenizer.vocab_size,
            max_positions=spec.seq_len + 1,
            hidden_size=spec.hidden_size,
            num_layers=spec.num_layers,
            num_heads=4,
        )
        return GPT(gpt_config, seed=seed)
    transformers = _transformers(spec)
    if spec.is_folder and not spec.is_config_file:
        model: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(
            spec.model, local_files_only=True, dtype=torch.float32
        )
        return _with_special_tokens(model, described.tokenizer, keep_unknown=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the same fresh weights on every rank and every run with this seed
        model = transformers.AutoModelForCausalLM.from_config(described.config)
    return _with_special_tokens(model, described.tokenizer, keep_unknown=False)
