"""Optimizer checkpoints of optimizers without parameter names (keyed by position), and the checks a load makes
against the optimizer it fills: its class, and its parameters' shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoint_helpers import assert_same_optimizer, assert_same_state, make_model, train
from cx_checkpoint import (
    CheckpointKind,
    CheckpointKindError,
    CheckpointReader,
    GeneralCheckpointIO,
    KeyMismatchError,
    ParamKey,
    TensorMismatchError,
    read_optimizer_meta,
    require_names,
)


def _optimizer_path(tmp_path: Path, shard: bool) -> Path:
    return tmp_path / ("optim" if shard else "optim.safetensors")


@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_checkpoint_optimizer_from_parameters_round_trips_by_position(tmp_path: Path, shard: bool) -> None:
    """The most common optimizer, built from model.parameters() (no names), saves and resumes exactly."""
    io = GeneralCheckpointIO()
    model = make_model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, 3, seed=1)
    io.save_model(model, tmp_path / "model.safetensors", use_safetensors=True)
    io.save_optimizer(optimizer, _optimizer_path(tmp_path, shard), shard=shard)

    with CheckpointReader.open(_optimizer_path(tmp_path, shard), CheckpointKind.OPTIMIZER) as reader:
        meta = read_optimizer_meta(reader)
    assert meta.keyed_by is ParamKey.POSITION
    assert meta.optimizer_class == "torch.optim.adam.Adam"
    assert set(meta.state) == {str(i) for i in range(len(list(model.parameters())))}

    resumed = make_model(5)
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.5)
    io.load_model(resumed, tmp_path / "model.safetensors")
    io.load_optimizer(resumed_optimizer, _optimizer_path(tmp_path, shard))
    assert_same_optimizer(optimizer, resumed_optimizer)
    train(model, optimizer, 2, seed=2)
    train(resumed, resumed_optimizer, 2, seed=2)
    assert_same_state(model.state_dict(), resumed.state_dict())


def test_checkpoint_named_optimizer_stays_keyed_by_name(tmp_path: Path) -> None:
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=1)
    GeneralCheckpointIO().save_optimizer(optimizer, tmp_path / "optim", shard=True)
    description = json.loads((tmp_path / "optim" / "optimizer.json").read_text())
    assert description["keyed_by"] == "name"
    assert "fc1.weight" in description["state"]
    assert description["param_shapes"]["fc1.weight"] == [16, 8]


def test_checkpoint_position_keyed_checkpoint_refused_where_names_are_needed(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model = make_model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=1)
    io.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    meta, _ = io.load_optimizer_parts(tmp_path / "optim")
    with pytest.raises(CheckpointKindError, match="keyed by parameter POSITION"):
        require_names(meta, "here")
    # a different layout (other parameter groups) cannot be matched by position
    groups: list[dict[str, Any]] = [{"params": [model.fc1.weight]}, {"params": [model.fc1.bias]}]
    split = torch.optim.Adam(groups, lr=1e-2)
    with pytest.raises(KeyMismatchError, match="param group"):
        io.load_optimizer(split, tmp_path / "optim")
    fewer = torch.optim.Adam(list(model.parameters())[:-1], lr=1e-2)
    with pytest.raises(KeyMismatchError, match="position-keyed checkpoint needs the same layout"):
        io.load_optimizer(fewer, tmp_path / "optim")


def test_checkpoint_optimizer_load_checks_shapes_and_kind(tmp_path: Path) -> None:
    """A load into another model shape or another kind of optimizer fails at load, not later inside step()."""
    io = GeneralCheckpointIO()
    model = make_model(0, hidden=16)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=1)
    io.save_optimizer(optimizer, tmp_path / "optim.safetensors")

    wider = make_model(0, hidden=32)  # same names, other shapes
    wider_optimizer = torch.optim.Adam(wider.named_parameters(), lr=1e-2)
    before = wider_optimizer.state_dict()
    with pytest.raises(TensorMismatchError, match=r"parameter 'fc1\.(weight|bias)' had shape \[16"):
        io.load_optimizer(wider_optimizer, tmp_path / "optim.safetensors")
    assert wider_optimizer.state_dict() == before, "a refused load leaves the optimizer untouched"

    sgd = torch.optim.SGD(make_model(0).named_parameters(), lr=1e-2, momentum=0.9)
    with pytest.raises(CheckpointKindError, match=r"saved by torch.optim.adam.Adam, loading into torch.optim.sgd.SGD"):
        io.load_optimizer(sgd, tmp_path / "optim.safetensors")


def test_checkpoint_optimizer_state_shape_checked_without_recorded_shapes(tmp_path: Path) -> None:
    """Descriptions that record no parameter shapes (older cx, ZeRO plugins) still get element-wise state checked."""
    io = GeneralCheckpointIO()
    model = make_model(0, hidden=16)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=1)
    io.save_optimizer(optimizer, tmp_path / "optim", shard=True)
    description_path = tmp_path / "optim" / "optimizer.json"
    description = json.loads(description_path.read_text())
    del description["param_shapes"], description["optimizer_class"]
    description_path.write_text(json.dumps(description))
    wider = make_model(0, hidden=32)
    with pytest.raises(TensorMismatchError, match=r"state 'exp_avg' of parameter 'fc1\.(weight|bias)' has shape \[16"):
        io.load_optimizer(torch.optim.Adam(wider.named_parameters(), lr=1e-2), tmp_path / "optim")
