"""The shape of every tensor in the model `--model` and the size flags describe, from a build on the meta device (no
memory, no weights read): what a `--resume` checkpoint must hold."""

from __future__ import annotations

import copy

import torch

from cx_train.models._spec import DescribedModel, _transformers, build_model

__all__ = ["model_shapes"]


def model_shapes(described: DescribedModel) -> dict[str, tuple[int, ...]]:
    """State-dict name -> shape of the model `build_model` makes (a weights folder built from its config instead, so
    that no weight is read)."""
    spec = described.spec
    with torch.device("meta"):
        if spec.is_folder and not spec.is_config_file:
            model = _transformers(spec).AutoModelForCausalLM.from_config(copy.deepcopy(described.config))
        else:
            model = build_model(described, seed=0)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
