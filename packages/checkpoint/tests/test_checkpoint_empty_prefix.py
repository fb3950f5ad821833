"""`prefix=""` is no prefix, as in ColossalAI's `add_prefix`: scripts pass `prefix=""` (or `""` positionally to
`load_optimizer`) and expect the same files as with no prefix at all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_helpers import assert_same_optimizer, assert_same_state, make_model, train
from cx_checkpoint import CheckpointKind, FileFormat, GeneralCheckpointIO, file_names, write_sharded


def test_empty_prefix_names_the_unprefixed_files() -> None:
    for kind, file_format in [
        (CheckpointKind.MODEL, FileFormat.SAFETENSORS),
        (CheckpointKind.MODEL, FileFormat.BIN),
        (CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS),
    ]:
        assert file_names(kind, file_format, "") == file_names(kind, file_format, None)
    with pytest.raises(ValueError, match="plain file-name prefix"):
        file_names(CheckpointKind.MODEL, FileFormat.SAFETENSORS, ".hidden")


@pytest.mark.parametrize("use_safetensors", [True, False], ids=["safetensors", "bin"])
def test_sharded_save_and_load_with_empty_prefix_equal_no_prefix(tmp_path: Path, use_safetensors: bool) -> None:
    model = make_model(0)
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    train(model, optimizer, steps=1, seed=0)
    io = GeneralCheckpointIO()
    for name, prefix in [("empty", ""), ("none", None)]:
        io.save_model(model, tmp_path / name, shard=True, prefix=prefix, use_safetensors=use_safetensors)
        io.save_optimizer(optimizer, tmp_path / name, shard=True, prefix=prefix)
    names = sorted(p.name for p in (tmp_path / "empty").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "none").iterdir())
    assert not any(n.startswith("-") for n in names)
    for saved in ("empty", "none"):
        for prefix in ("", None):
            other_model = make_model(1)
            other = torch.optim.SGD(other_model.named_parameters(), lr=0.1, momentum=0.9)
            io.load_model(other_model, tmp_path / saved)
            io.load_optimizer(other, tmp_path / saved, prefix)  # ColossalAI's positional order
            assert_same_state(model.state_dict(), other_model.state_dict())
            assert_same_optimizer(optimizer, other)


def test_empty_prefix_is_accepted_for_single_files(tmp_path: Path) -> None:
    """An unsharded save or a single-file load with `prefix=""` has no prefix to refuse."""
    model = make_model(0)
    optimizer = torch.optim.SGD(model.named_parameters(), lr=0.1, momentum=0.9)
    train(model, optimizer, steps=1, seed=0)
    io = GeneralCheckpointIO()
    io.save_model(model, tmp_path / "model.safetensors", prefix="", use_safetensors=True)
    io.save_optimizer(optimizer, tmp_path / "optimizer.safetensors", prefix="")
    other_model = make_model(1)
    other = torch.optim.SGD(other_model.named_parameters(), lr=0.1, momentum=0.9)
    io.load_model(other_model, tmp_path / "model.safetensors")
    io.load_optimizer(other, tmp_path / "optimizer.safetensors", "")
    assert_same_state(model.state_dict(), other_model.state_dict())
    assert_same_optimizer(optimizer, other)


def test_write_sharded_with_empty_prefix(tmp_path: Path) -> None:
    write_sharded(tmp_path / "empty", [("w", torch.ones(2))], prefix="")
    write_sharded(tmp_path / "none", [("w", torch.ones(2))])
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == sorted(
        p.name for p in (tmp_path / "none").iterdir()
    )
