"""The on-disk format: Hugging Face index and file names, shard cutting, safetensors compatibility, lazy reads."""

from __future__ import annotations

import itertools
import json
import random
import re
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cx_checkpoint import (
    CheckpointIndexFile,
    CheckpointKind,
    CheckpointReader,
    FileFormat,
    ShardWriter,
    file_names,
    write_sharded,
)

SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _tensors(seed: int, count: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = [int(torch.randint(1, 300, (1,), generator=generator)) for _ in range(count)]
    return {f"layers.{i}.weight": torch.randn(size, generator=generator) for i, size in enumerate(sizes)}


def test_checkpoint_index_matches_hugging_face_spec(tmp_path: Path) -> None:
    tensors = _tensors(0, 12)
    items = list(tensors.items())
    random.Random(1).shuffle(items)  # any order
    index = write_sharded(tmp_path / "ckpt", items, size_per_shard=2000 / 2**20)
    raw = (tmp_path / "ckpt" / "model.safetensors.index.json").read_text()
    data = json.loads(raw)
    # transformers writes json.dumps(index, indent=2, sort_keys=True) + "\n"
    assert raw == json.dumps(data, indent=2, sort_keys=True) + "\n"
    assert set(data) == {"metadata", "weight_map"}
    files = sorted(set(data["weight_map"].values()))
    # cx adds one checksum per shard file (other readers ignore extra metadata keys)
    checksums = {f: f"crc32:{zlib.crc32((tmp_path / 'ckpt' / f).read_bytes()):08x}" for f in files}
    assert data["metadata"] == {"total_size": sum(t.numel() * 4 for t in tensors.values()), "cx_checksums": checksums}
    assert data["weight_map"] == index.weight_map
    assert set(data["weight_map"]) == set(tensors)
    numbers = [SHARD_NAME.match(f) for f in files]
    assert all(numbers)
    total = len(files)
    assert [int(m.group(1)) for m in numbers if m] == list(range(1, total + 1))
    assert all(int(m.group(2)) == total for m in numbers if m)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [*files, "model.safetensors.index.json"]
    for file_name in files:  # every shard is a plain safetensors file with HF's format marker
        loaded = load_file(tmp_path / "ckpt" / file_name)
        for name, tensor in loaded.items():
            assert data["weight_map"][name] == file_name
            assert torch.equal(tensor, tensors[name])
        with safe_open(str(tmp_path / "ckpt" / file_name), framework="pt") as handle:
            assert handle.metadata()["format"] == "pt"
            assert handle.metadata()["cx_kind"] == "model"
    assert CheckpointIndexFile.from_file(tmp_path / "ckpt" / "model.safetensors.index.json") == index


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(min_value=0, max_value=400), min_size=1, max_size=20),
    limit=st.integers(min_value=1, max_value=2000),
)
def test_checkpoint_shards_cut_at_limit(tmp_path_factory: pytest.TempPathFactory, sizes: list[int], limit: int) -> None:
    """Each shard stays within the limit unless it holds one larger tensor alone; order and content are kept."""
    directory = tmp_path_factory.mktemp("shards")
    writer = ShardWriter(
        directory, file_format=FileFormat.SAFETENSORS, max_shard_bytes=limit, metadata={"format": "pt"}
    )
    tensors = {f"t{i}": torch.full((size,), float(i), dtype=torch.float16) for i, size in enumerate(sizes)}
    writer.extend(tensors.items())
    shards = writer.close()
    flattened = [name for shard in shards for name, _ in shard.tensors]
    assert flattened == list(tensors)
    for shard in shards:
        size = sum(nbytes for _, nbytes in shard.tensors)
        assert size <= limit or len(shard.tensors) == 1
        loaded = load_file(directory / shard.file_name)
        assert {name: t.clone() for name, t in loaded.items()}.keys() == {name for name, _ in shard.tensors}
    for shard_a, shard_b in itertools.pairwise(shards):  # greedy: the next tensor did not fit
        first_of_next = shard_b.tensors[0][1]
        assert sum(n for _, n in shard_a.tensors) + first_of_next > limit


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
    ],
)
def test_checkpoint_safetensors_files_interoperate(tmp_path: Path, dtype: torch.dtype) -> None:
    """Our files load with safetensors' loader, and files safetensors wrote load through our reader."""
    tensors = {
        "a": (torch.randn(3, 5) * 4).to(dtype),
        "scalar": torch.tensor(2.0).to(dtype),
        "empty": torch.zeros(0, 2, dtype=dtype),
        "b": (torch.randn(7) * 4).to(dtype),
    }
    write_sharded(tmp_path / "ours", tensors.items())
    ours = load_file(tmp_path / "ours" / "model-00001-of-00001.safetensors")
    assert ours.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert ours[name].dtype == dtype
        assert ours[name].shape == tensor.shape
        assert torch.equal(_bytes(ours[name]), _bytes(tensor))
    save_file(tensors, str(tmp_path / "theirs.safetensors"))
    with CheckpointReader.open(tmp_path / "theirs.safetensors") as reader:
        for name, tensor in tensors.items():
            assert torch.equal(_bytes(reader.read(name)), _bytes(tensor))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_checkpoint_reader_reads_regions_lazily(tmp_path: Path) -> None:
    full = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    write_sharded(tmp_path / "c", [("w", full), ("v", torch.ones(3))])
    with CheckpointReader.open(tmp_path / "c") as reader:
        assert torch.equal(reader.read("w", (slice(2, 4),)), full[2:4])
        assert torch.equal(reader.read("w", (slice(1, 5), slice(3, 7))), full[1:5, 3:7])
        assert torch.equal(reader.read("w", (slice(6, 6),)), full[6:6])
        with pytest.raises(ValueError, match="outside dimension 0 of size 6"):
            reader.read("w", (slice(4, 8),))
        with pytest.raises(ValueError, match="step"):
            reader.read("w", (slice(0, 6, 2),))
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            reader.read("nope")


def test_checkpoint_file_names() -> None:
    model = file_names(CheckpointKind.MODEL, FileFormat.SAFETENSORS)
    assert (model.single, model.index, model.shard(1, 3)) == (
        "model.safetensors",
        "model.safetensors.index.json",
        "model-00001-of-00003.safetensors",
    )
    legacy = file_names(CheckpointKind.MODEL, FileFormat.BIN)
    assert (legacy.single, legacy.index, legacy.shard(2, 2)) == (
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "pytorch_model-00002-of-00002.bin",
    )
    optimizer = file_names(CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS, prefix="step3")
    assert (optimizer.index, optimizer.optimizer_json) == (
        "step3-optimizer.safetensors.index.json",
        "step3-optimizer.json",
    )
    assert model.owns("model-00004-of-00009.safetensors")
    assert not model.owns("optimizer-00001-of-00001.safetensors")
    with pytest.raises(ValueError, match="no pickle"):
        file_names(CheckpointKind.OPTIMIZER, FileFormat.BIN)
    with pytest.raises(ValueError, match=r"outside 1\.\.3"):
        model.shard(4, 3)
    with pytest.raises(ValueError, match="plain file-name prefix"):
        file_names(CheckpointKind.MODEL, FileFormat.SAFETENSORS, prefix="../x")


def test_checkpoint_writer_rejects_bad_streams(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="given twice"):
        write_sharded(tmp_path / "dup", [("a", torch.ones(1)), ("a", torch.ones(1))])
    with pytest.raises(TypeError, match="not a tensor"):
        write_sharded(tmp_path / "bad", [("a", [1.0])])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="positive number of MB"):
        write_sharded(tmp_path / "size", [("a", torch.ones(1))], size_per_shard=0)
    assert not list(tmp_path.iterdir())  # nothing committed, no staging left behind
