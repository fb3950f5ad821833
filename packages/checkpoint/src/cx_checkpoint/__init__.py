"""cx-checkpoint: sharded, atomic, reshardable checkpoints in the Hugging Face layout, with no pickle.

- `CheckpointIO` (abstract) and `GeneralCheckpointIO` (single process, plain modules and optimizers).
- `CheckpointIndexFile`: the HF `*.index.json`; `file_names` gives `model-00001-of-00003.safetensors`-style names.
- `write_sharded`: the streaming shard writer (any rank count writing in parallel, one merged index, atomic commit).
- `TensorSource` / `TensorSink`: the protocols parallel owners of state implement to save and load by global name;
  `CheckpointReader` + `load_into` read lazily, only the regions each sink owns.
- `DTensorModuleSink` / `local_region`: loading into DTensor parameters, each rank reading only its shard's region.
- Optimizer state keyed by parameter name: `OptimizerMeta`, `optimizer_tensor_name`, `attach_param_names`.
- Checksums: `verify_checkpoints` (and `cx-checkpoint-verify`); `record_checksums` for a caller's own files beside
  its checkpoints (a trainer's state JSON), listed in a `CHECKSUMS_FILE` manifest that verification checks too.
- `CheckpointError` and its subclasses for every problem found on load.
The file format is specified in docs/checkpoint.md.
"""

from cx_checkpoint._agree import run_and_agree
from cx_checkpoint._atomic import commit_directory, fsync_file, remove_stale_staging, staging_path
from cx_checkpoint._checkpoint_io import DEFAULT_SIZE_PER_SHARD, CheckpointIO, Stateful
from cx_checkpoint._dtensor import DTensorModuleSink, local_region
from cx_checkpoint._errors import (
    CheckpointError,
    CheckpointIndexError,
    CheckpointKindError,
    CheckpointNotFoundError,
    CheckpointPathError,
    CheckpointSaveError,
    ChecksumMismatchError,
    CorruptShardError,
    KeyMismatchError,
    MissingShardError,
    TensorMismatchError,
    UnsafeCheckpointError,
)
from cx_checkpoint._general import GeneralCheckpointIO, read_optimizer_meta
from cx_checkpoint._hf_config import hf_side_files, write_side_files
from cx_checkpoint._index import CheckpointIndexFile
from cx_checkpoint._loading import LoadResult, load_into
from cx_checkpoint._manifest import CHECKSUMS_FILE, record_checksums
from cx_checkpoint._module import ModuleSink, ModuleSource
from cx_checkpoint._naming import CheckpointKind, FileFormat, FileNames, file_names
from cx_checkpoint._optimizer import (
    OPTIMIZER_FORMAT,
    OptimizerMeta,
    ParamKey,
    attach_param_names,
    check_optimizer_class,
    optimizer_class_name,
    optimizer_param_names,
    optimizer_tensor_name,
    require_names,
    restore_optimizer,
    split_optimizer,
)
from cx_checkpoint._protocols import Region, TensorSink, TensorSource, TensorSpec, iter_source
from cx_checkpoint._reader import CheckpointReader
from cx_checkpoint._verify import VerifyOutcome, VerifyResult, verify_checkpoints
from cx_checkpoint._writer import ShardWriter, WrittenShard, write_sharded

__all__ = [
    # checkpoint IO
    "DEFAULT_SIZE_PER_SHARD",
    "CheckpointIO",
    "GeneralCheckpointIO",
    "LoadResult",
    "Stateful",
    # layout
    "CheckpointIndexFile",
    "CheckpointKind",
    "FileFormat",
    "FileNames",
    "file_names",
    # Hugging Face side files (config.json, generation_config.json)
    "hf_side_files",
    "write_side_files",
    # streaming write and lazy read
    "ShardWriter",
    "WrittenShard",
    "write_sharded",
    "run_and_agree",
    # atomic placement (for callers that commit several checkpoints as one)
    "commit_directory",
    "fsync_file",
    "remove_stale_staging",
    "staging_path",
    "CheckpointReader",
    "load_into",
    # protocols
    "Region",
    "TensorSink",
    "TensorSource",
    "TensorSpec",
    "iter_source",
    "ModuleSink",
    "ModuleSource",
    "DTensorModuleSink",
    "local_region",
    # optimizer state by name
    "OPTIMIZER_FORMAT",
    "OptimizerMeta",
    "ParamKey",
    "attach_param_names",
    "check_optimizer_class",
    "optimizer_class_name",
    "optimizer_param_names",
    "optimizer_tensor_name",
    "read_optimizer_meta",
    "require_names",
    "restore_optimizer",
    "split_optimizer",
    # checksums
    "CHECKSUMS_FILE",
    "record_checksums",
    "VerifyOutcome",
    "VerifyResult",
    "verify_checkpoints",
    # errors
    "CheckpointError",
    "CheckpointIndexError",
    "CheckpointKindError",
    "CheckpointNotFoundError",
    "CheckpointPathError",
    "CheckpointSaveError",
    "ChecksumMismatchError",
    "CorruptShardError",
    "KeyMismatchError",
    "MissingShardError",
    "TensorMismatchError",
    "UnsafeCheckpointError",
]
