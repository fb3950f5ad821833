"""`cx-checkpoint-verify` checks everything a load reads: the optimizer description `optimizer.json` and other side
files (checksummed in the index), a single file's header (its optimizer description included), files a caller
records with `record_checksums` (cx-train's `trainer.json`), and single tensor files of any name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import make_model, train
from cx_checkpoint import (
    CHECKSUMS_FILE,
    ChecksumMismatchError,
    GeneralCheckpointIO,
    VerifyOutcome,
    VerifyResult,
    record_checksums,
    verify_checkpoints,
    write_sharded,
)
from cx_checkpoint._verify import main


def _flip_bit(path: Path, from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - from_end] ^= 0x10
    path.write_bytes(bytes(data))


def _by_name(results: list[VerifyResult]) -> dict[str, VerifyResult]:
    return {result.path.name: result for result in results}


def _trained_adam() -> torch.optim.Optimizer:
    model = make_model(0)
    optimizer = torch.optim.Adam(model.named_parameters(), lr=1e-2)
    train(model, optimizer, 1, seed=0)
    return optimizer


def test_truncated_optimizer_json_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    GeneralCheckpointIO().save_optimizer(_trained_adam(), tmp_path / "optimizer", shard=True)
    index = "optimizer.safetensors.index.json"
    assert "optimizer.json" in json.loads((tmp_path / "optimizer" / index).read_text())["metadata"]["cx_checksums"]
    assert main([str(tmp_path)]) == 0
    assert "side file(s) optimizer.json" in capsys.readouterr().out
    description = tmp_path / "optimizer" / "optimizer.json"
    description.write_bytes(description.read_bytes()[:-20])  # a partial copy: loading it fails
    result = _by_name(verify_checkpoints(tmp_path))[index]
    assert result.outcome is VerifyOutcome.FAILED
    assert "optimizer.json" in result.detail, result.detail
    assert "ChecksumMismatchError" in result.detail, result.detail
    assert main([str(tmp_path)]) == 1
    with pytest.raises(ChecksumMismatchError, match=r"optimizer\.json"):
        GeneralCheckpointIO().load_optimizer(_trained_adam(), tmp_path / "optimizer", verify=True)


def test_unparsable_optimizer_json_without_checksum_is_reported(tmp_path: Path) -> None:
    """A checkpoint from before side files had checksums: the description is still parsed (and named)."""
    GeneralCheckpointIO().save_optimizer(_trained_adam(), tmp_path / "optimizer", shard=True)
    index_path = tmp_path / "optimizer" / "optimizer.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["metadata"]["cx_checksums"]["optimizer.json"]
    index_path.write_text(json.dumps(index))
    assert "parsed only" in verify_checkpoints(tmp_path)[0].detail
    description = tmp_path / "optimizer" / "optimizer.json"
    description.write_bytes(description.read_bytes()[:-20])
    result = verify_checkpoints(tmp_path)[0]
    assert result.outcome is VerifyOutcome.FAILED
    assert "optimizer.json" in result.detail, result.detail
    assert "not valid JSON" in result.detail, result.detail


def test_side_file_recorded_in_index_is_checked(tmp_path: Path) -> None:
    def config(staging: Path) -> None:
        (staging / "config.json").write_text('{"hidden_size": 16}')

    write_sharded(tmp_path / "model", [("w", torch.ones(4))], extra_files=config)
    assert verify_checkpoints(tmp_path)[0].outcome is VerifyOutcome.OK
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 61}')  # still valid JSON: only a checksum sees it
    result = verify_checkpoints(tmp_path)[0]
    assert result.outcome is VerifyOutcome.FAILED
    assert "config.json" in result.detail, result.detail
    (tmp_path / "model" / "config.json").unlink()
    assert "config.json, recorded with a checksum at save, is missing" in verify_checkpoints(tmp_path)[0].detail


def test_single_optimizer_file_header_is_checked(tmp_path: Path) -> None:
    """The description of an unsharded optimizer lives in the header, which the data checksum does not cover."""
    path = tmp_path / "optimizer.safetensors"
    GeneralCheckpointIO().save_optimizer(_trained_adam(), path)
    assert verify_checkpoints(tmp_path)[0].outcome is VerifyOutcome.OK
    raw = path.read_bytes()
    assert raw.count(b"0.01") == 1  # the learning rate in the description
    path.write_bytes(raw.replace(b"0.01", b"0.07"))  # same length: every structural check still passes
    result = verify_checkpoints(tmp_path)[0]
    assert result.outcome is VerifyOutcome.FAILED
    assert "checksum" in result.detail, result.detail
    assert "header" in result.detail, result.detail


def test_recorded_trainer_json_is_checked(tmp_path: Path) -> None:
    """A caller's own JSON beside its checkpoints (cx-train's trainer.json), recorded with `record_checksums`."""
    state = tmp_path / "trainer.json"
    state.write_text(json.dumps({"step": 120, "plugin": "gemini", "world_size": 2}, indent=2))
    record_checksums(tmp_path, [state.name])
    assert json.loads((tmp_path / CHECKSUMS_FILE).read_text())["files"].keys() == {"trainer.json"}
    assert _by_name(verify_checkpoints(tmp_path))[CHECKSUMS_FILE].outcome is VerifyOutcome.OK
    assert main([str(tmp_path)]) == 0
    original = state.read_text()
    state.write_text(original.replace("120", "720"))  # corrupt but still valid JSON
    result = _by_name(verify_checkpoints(tmp_path))[CHECKSUMS_FILE]
    assert result.outcome is VerifyOutcome.FAILED
    assert "trainer.json" in result.detail, result.detail
    assert "ChecksumMismatchError" in result.detail, result.detail
    state.write_text(original[:-5])  # truncated
    assert "trainer.json" in _by_name(verify_checkpoints(tmp_path))[CHECKSUMS_FILE].detail
    state.unlink()
    assert "trainer.json, recorded with a checksum, is missing" in verify_checkpoints(tmp_path)[0].detail
    assert main([str(tmp_path)]) == 1
    with pytest.raises(ValueError, match="not a plain file name"):
        record_checksums(tmp_path, ["../trainer.json"])


def test_suffixless_model_file_is_found_and_checked(tmp_path: Path) -> None:
    """An unsharded model may have any name: verify tells it by content, as the loader does."""
    GeneralCheckpointIO().save_model(make_model(0), tmp_path / "weights", use_safetensors=True)
    torch.save(make_model(0).state_dict(), tmp_path / "legacy")
    (tmp_path / "notes").write_text("not a checkpoint")
    results = _by_name(verify_checkpoints(tmp_path))
    assert set(results) == {"weights", "legacy"}
    assert results["weights"].outcome is VerifyOutcome.OK
    assert results["legacy"].outcome is VerifyOutcome.UNVERIFIABLE  # torch.save files carry no checksum
    _flip_bit(tmp_path / "weights", from_end=3)
    result = _by_name(verify_checkpoints(tmp_path))["weights"]
    assert result.outcome is VerifyOutcome.FAILED
    assert "ChecksumMismatchError" in result.detail, result.detail


def test_json_without_a_checksum_is_still_parsed(tmp_path: Path) -> None:
    """JSON no index or manifest records (an LR scheduler's state, a trainer.json saved without a manifest) is at
    least parsed: a truncated one fails, naming the file; a whole one is OK as parsed only. An optimizer's own
    description is parsed with its checkpoint, not listed twice."""
    GeneralCheckpointIO().save_optimizer(_trained_adam(), tmp_path / "optimizer", shard=True)
    scheduler = tmp_path / "lr_scheduler.json"
    scheduler.write_text(json.dumps({"last_epoch": 3, "base_lrs": [0.01]}))
    trainer = tmp_path / "trainer.json"
    trainer.write_text(json.dumps({"step": 12, "plugin": "gemini", "world_size": 2}))
    results = _by_name(verify_checkpoints(tmp_path))
    assert "optimizer.json" not in results
    for name in ("lr_scheduler.json", "trainer.json"):
        assert results[name].outcome is VerifyOutcome.OK
        assert results[name].detail == "JSON with no checksum recorded: parsed only"
    assert main([str(tmp_path)]) == 0
    trainer.write_text(trainer.read_text()[:-7])
    failed = _by_name(verify_checkpoints(tmp_path))["trainer.json"]
    assert failed.outcome is VerifyOutcome.FAILED
    assert "trainer.json: JSON is not valid JSON" in failed.detail, failed.detail
    assert main([str(tmp_path)]) == 1
