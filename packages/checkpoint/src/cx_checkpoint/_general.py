"""`GeneralCheckpointIO`: the single-process `CheckpointIO` for a plain `nn.Module` and `torch.optim.Optimizer`.

Every save collects full tensors (gathering DTensors), optionally stages them to CPU for an async write, and then
runs one job: an atomic single file, or `write_sharded` into a directory. Loads open a verified `CheckpointReader`
and copy tensor by tensor, so peak extra memory is one tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from cx_checkpoint._async import stage_to_cpu
from cx_checkpoint._atomic import write_file_atomic
from cx_checkpoint._checkpoint_io import DEFAULT_SIZE_PER_SHARD, CheckpointIO
from cx_checkpoint._errors import CheckpointIndexError, CheckpointKindError, KeyMismatchError
from cx_checkpoint._files import write_bin, write_safetensors
from cx_checkpoint._hf_config import hf_side_files, write_side_files
from cx_checkpoint._loading import LoadResult, load_into
from cx_checkpoint._module import ModuleSink, full_state
from cx_checkpoint._naming import CheckpointKind, FileFormat, file_names
from cx_checkpoint._optimizer import OptimizerMeta, describe_tensors, restore_optimizer, split_optimizer
from cx_checkpoint._reader import CheckpointReader
from cx_checkpoint._writer import write_sharded

__all__ = ["GeneralCheckpointIO", "read_optimizer_meta"]


class GeneralCheckpointIO(CheckpointIO):
    """Checkpoints of one process's full model and optimizer, in the cx (Hugging Face) layout."""

    # ---- model ---------------------------------------------------------------------------------------------------
    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None:
        state = full_state(model.state_dict(), gather_dtensor, "model tensor")
        side = hf_side_files(model)
        if use_async:
            state = stage_to_cpu(state)

        def job() -> None:
            if use_safetensors:
                metadata = {"format": "pt", "cx_kind": CheckpointKind.MODEL.value}
                write_file_atomic(
                    checkpoint, lambda tmp: write_safetensors(tmp, state, metadata, checksum_in_header=True)
                )
            else:
                write_file_atomic(checkpoint, lambda tmp: write_bin(tmp, state))
            for name, content in side.items():
                write_file_atomic(checkpoint.parent / name, _bytes_writer(content))

        self._run(job, use_async)

    def save_sharded_model(
        self,
        model: nn.Module,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
        use_async: bool,
    ) -> None:
        state = full_state(model.state_dict(), gather_dtensor, "model tensor")
        side = hf_side_files(model)
        if use_async:
            state = stage_to_cpu(state)
        file_format = FileFormat.SAFETENSORS if use_safetensors else FileFormat.BIN

        def job() -> None:
            write_sharded(
                checkpoint,
                state.items(),
                kind=CheckpointKind.MODEL,
                file_format=file_format,
                size_per_shard=size_per_shard,
                prefix=prefix,
                extra_files=lambda directory: write_side_files(directory, side),
            )

        self._run(job, use_async)

    def load_unsharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        with CheckpointReader.open(checkpoint, CheckpointKind.MODEL) as reader:
            return load_into(reader, ModuleSink(model), strict=strict)

    def load_sharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult:
        with CheckpointReader.open(checkpoint, CheckpointKind.MODEL) as reader:
            return load_into(reader, ModuleSink(model), strict=strict)

    # ---- optimizer -----------------------------------------------------------------------------------------------
    def save_unsharded_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, gather_dtensor: bool, use_async: bool
    ) -> None:
        meta, tensors = split_optimizer(optimizer, gather_dtensor)
        self.save_optimizer_parts(meta, tensors, checkpoint, shard=False, use_async=use_async)

    def save_sharded_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None:
        meta, tensors = split_optimizer(optimizer, gather_dtensor)
        self.save_optimizer_parts(
            meta, tensors, checkpoint, shard=True, prefix=prefix, size_per_shard=size_per_shard, use_async=use_async
        )

    def save_optimizer_parts(
        self,
        meta: OptimizerMeta,
        tensors: dict[str, torch.Tensor],
        checkpoint: Path,
        *,
        shard: bool,
        prefix: str | None = None,
        size_per_shard: float = DEFAULT_SIZE_PER_SHARD,
        use_async: bool = False,
    ) -> None:
        """Write an optimizer checkpoint from its parts: the JSON description and the full state tensors by name.

        For owners of optimizer state that is not a plain torch optimizer (ZeRO optimizers gather theirs first).
        """
        if use_async:
            tensors = stage_to_cpu(tensors)
        if not shard:
            metadata = {"format": "pt", "cx_kind": CheckpointKind.OPTIMIZER.value, "cx_optimizer": meta.to_json()}
            self._run(
                lambda: write_file_atomic(
                    checkpoint, lambda tmp: write_safetensors(tmp, tensors, metadata, checksum_in_header=True)
                ),
                use_async,
            )
            return
        text = meta.to_json()
        json_name = file_names(CheckpointKind.OPTIMIZER, FileFormat.SAFETENSORS, prefix).optimizer_json

        def job() -> None:
            write_sharded(
                checkpoint,
                tensors.items(),
                kind=CheckpointKind.OPTIMIZER,
                size_per_shard=size_per_shard,
                prefix=prefix,
                extra_files=lambda directory: (directory / json_name).write_text(text),
            )

        self._run(job, use_async)

    def load_optimizer_parts(
        self, checkpoint: str | os.PathLike[str], prefix: str | None = None
    ) -> tuple[OptimizerMeta, dict[str, torch.Tensor]]:
        """Read an optimizer checkpoint (file, index or directory) as its JSON description and full state tensors."""
        with CheckpointReader.open(Path(checkpoint), CheckpointKind.OPTIMIZER, prefix) as reader:
            meta = read_optimizer_meta(reader)
            where = str(reader.index_path or reader.path)
            names = describe_tensors(meta)
            absent = [name for name in names if name not in reader.specs]
            if absent:
                raise KeyMismatchError(
                    f"{where}: the optimizer description names state tensors the files lack", absent, []
                )
            return meta, {name: reader.read(name) for name in names}

    def load_unsharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
        self._load_optimizer(optimizer, checkpoint, None)

    def load_sharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        self._load_optimizer(optimizer, checkpoint, prefix)

    def _load_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None) -> None:
        with CheckpointReader.open(checkpoint, CheckpointKind.OPTIMIZER, prefix) as reader:
            meta = read_optimizer_meta(reader)
            where = str(reader.index_path or reader.path)
            absent = [name for name in describe_tensors(meta) if name not in reader.specs]
            if absent:
                raise KeyMismatchError(
                    f"{where}: the optimizer description names state tensors the files lack", absent, []
                )
            restore_optimizer(optimizer, meta, reader.read, where)


def read_optimizer_meta(reader: CheckpointReader) -> OptimizerMeta:
    """The JSON part of an optimizer checkpoint opened with `CheckpointReader.open(..., CheckpointKind.OPTIMIZER)`."""
    if reader.index_path is None:
        text = reader.metadata_of(reader.path.name).get("cx_optimizer")
        if text is None:
            raise CheckpointKindError(f"{reader.path}: safetensors file without a cx optimizer description")
        return OptimizerMeta.from_json(text, str(reader.path))
    stem = reader.index_path.name.removesuffix(".safetensors.index.json")
    json_path = reader.index_path.parent / f"{stem}.json"
    text = reader.side_text(json_path.name)  # read with the index, from the same save
    if text is None:
        raise CheckpointIndexError(
            f"{reader.index_path}: the optimizer description {json_path.name} is missing beside it"
        )
    return OptimizerMeta.from_json(text, str(json_path))


def _bytes_writer(content: bytes) -> Callable[[Path], object]:
    return lambda path: path.write_bytes(content)
