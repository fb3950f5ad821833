"""`cx-plan --measure`: the live-storage tracker counts bytes exactly, and the command runs the best configuration on
local ranks and prints its measured peak and step time beside the prediction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from cx_plan import load_model_shape
from cx_plan._candidate import Candidate
from cx_plan._cli import main
from cx_plan.measure._measure import LiveBytes, fresh_model, measure_candidate


def test_live_bytes_counts_each_storage_once_until_it_is_freed() -> None:
    with LiveBytes() as tracker:
        a = torch.empty(1000)  # 4000 bytes
        view = a.view(10, 100)  # the same storage: nothing more
        b = torch.ones(500, dtype=torch.float64)  # 4000 more
        assert tracker.live == 8000
        del b
        assert tracker.live == 4000
        a.add_(1.0)  # in place: still one storage
        tracker.reset_peak()
        assert (tracker.live, tracker.peak) == (4000, 4000)
        c = torch.zeros(250)  # 1000 more
    assert tracker.peak == 5000
    assert view.numel() + c.numel() == 1250


def test_live_bytes_follows_storage_resizes() -> None:
    """FSDP and cx-chunk release memory by resizing a storage to 0 outside any op: the tracker must see it."""
    with LiveBytes() as tracker:
        a = torch.empty(1000)
        a.untyped_storage().resize_(0)
        assert tracker.live == 0
        a.untyped_storage().resize_(2000)  # regrown in place: 2000 bytes
        assert (tracker.live, tracker.peak) == (2000, 4000)
    assert torch.UntypedStorage.resize_ is not None
    b = torch.empty(10)
    b.untyped_storage().resize_(0)  # outside the tracker: the original method again
    assert tracker.live == 2000


def test_live_bytes_counts_a_dtensor_by_its_local_storage() -> None:
    """FSDP2's gradients are DTensors viewing one reduce-scattered buffer. A DTensor's own (wrapper) storage holds no
    data and is sized by its view's offset, so counting it charged the buffer's tail once per gradient (torch_fsdp
    measured at 2-3.3x its peak); the tracker counts the local tensors, here one 4000-byte buffer."""
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (1,))
        with LiveBytes() as tracker:
            buffer = torch.zeros(1000)
            views = [DTensor.from_local(buffer[i * 250 : (i + 1) * 250], mesh, [Shard(0)]) for i in range(4)]
            for view in views:
                view.add_(1.0)  # in place: each view's storage is the buffer's (wrapper storages: 1000 .. 4000 each)
            assert tracker.live == 4000
            moment = torch.zeros_like(views[3])  # a new local tensor of 250 elements: 1000 bytes
            assert (tracker.live, tracker.peak) == (5000, 5000)
        assert isinstance(moment, DTensor)
        assert moment.to_local().numel() == 250
    finally:
        dist.destroy_process_group()


def test_measure_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="--steps must be at least 1"):
        measure_candidate(Candidate("torch_ddp"), "gpt", steps=0)


def test_cx_plan_measure_runs_the_best_here(capsys: pytest.CaptureFixture[str]) -> None:
    hidden, layers, seq = 32, 2, 16
    flags = ["--model", "gpt", "--hidden-size", str(hidden), "--num-layers", str(layers), "--seq-len", str(seq),
             "--world", "1", "--device", "cpu", "--global-batch", "1", "--precision", "fp32", "--checkpointing", "0",
             "--plugins", "torch_ddp", "--measure", "--top", "1", "--steps", "1"]  # fmt: skip
    assert main(flags) == 0
    out = capsys.readouterr().out
    assert "cx-plan --measure: predicted vs measured" in out
    line = next(line for line in out.splitlines()[::-1] if line.startswith("torch_ddp mb1x1 fp32"))
    fields = line.split()
    predicted, measured, rss = float(fields[3]), float(fields[4]), float(fields[6])
    # after the warm-up step the fp32 parameters, their gradients and AdamW's two moments are all live during the
    # timed step: 16 bytes a parameter at least; the process's RSS holds them and the interpreter besides
    states = 16 * load_model_shape("gpt", hidden_size=hidden, num_layers=layers, seq_len=seq).parameters.total / 1e6
    assert states <= measured < rss
    assert predicted >= states
    assert line.rstrip().endswith("1/1")  # the only configuration that ran ranks first both ways


def _bare_llama(folder: Path) -> Path:
    """A folder holding only a tiny Llama's config.json: an architecture, no weights or tokenizer."""
    config = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, "tie_word_embeddings": False}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_fresh_model_is_seeded_and_needs_no_weights(tmp_path: Path) -> None:
    """A bare config.json builds the same fresh weights every time (every rank of a measurement agrees), another
    seed gives others, and the caller's RNG stream is left alone."""
    shape = load_model_shape(str(_bare_llama(tmp_path)))
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first, again, other = fresh_model(shape), fresh_model(shape), fresh_model(shape, seed=1)
    assert torch.equal(torch.rand(3), expected_next)
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters(), strict=True))


def test_cx_plan_measure_of_a_folder_with_only_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: `--measure` on a folder holding only config.json measured nothing ("no file named
    model.safetensors") and exited 0. It now trains fresh seeded weights and measures a peak."""
    folder = _bare_llama(tmp_path)
    flags = ["--model", str(folder), "--seq-len", "16", "--world", "1", "--device", "cpu", "--global-batch", "1",
             "--precision", "fp32", "--checkpointing", "0", "--plugins", "torch_ddp", "--measure", "--top", "1",
             "--steps", "1", "--quiet"]  # fmt: skip
    assert main(flags) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines()[::-1] if line.startswith("torch_ddp mb1x1 fp32"))
    assert "failed" not in line
    states = 16 * load_model_shape(str(folder)).parameters.total / 1e6  # fp32 weights, gradients, two moments
    assert float(line.split()[4]) >= states
