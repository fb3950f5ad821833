"""`CheckpointIO`: the abstract save/load interface every cx plugin implements (ColossalAI's, without pickle).

The public methods validate arguments and dispatch to the sharded or unsharded hooks a subclass implements;
learning-rate schedulers are handled here (their state is plain data, stored as tagged JSON). Asynchronous saves go
through one background writer per `CheckpointIO`; `synchronize()` waits for them and re-raises their errors, and
every load first waits for them (raising the error of one that failed), so it never reads a half-finished save.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from cx_checkpoint._async import AsyncWriter
from cx_checkpoint._atomic import write_file_atomic
from cx_checkpoint._errors import CheckpointKindError, CheckpointNotFoundError
from cx_checkpoint._json_codec import decode, encode, parse_json
from cx_checkpoint._loading import LoadResult
from cx_checkpoint._reader import VERIFY_BY_DEFAULT
from cx_checkpoint._writer import megabytes_to_bytes

__all__ = ["DEFAULT_SIZE_PER_SHARD", "CheckpointIO", "Stateful"]

DEFAULT_SIZE_PER_SHARD = 1024
_SCHEDULER_FORMAT = "cx-lr-scheduler/1"
PathLike = str | os.PathLike[str]


class Stateful(Protocol):
    """Anything with `state_dict()` / `load_state_dict()` of plain data (e.g. an LR scheduler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class CheckpointIO(ABC):
    """Save and load models, optimizers and LR schedulers; subclasses implement the sharded/unsharded hooks."""

    def __init__(self) -> None:
        self._async = AsyncWriter()

    # ---- model ---------------------------------------------------------------------------------------------------
    def save_model(
        self,
        model: nn.Module,
        checkpoint: PathLike,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = DEFAULT_SIZE_PER_SHARD,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Save `model`'s weights: a single file at `checkpoint`, or (`shard=True`) a directory of shards + index.

        A single file may have any name (ColossalAI's tests save to `.../model`): it holds safetensors when
        `use_safetensors`, else the legacy bin format, and `load_model` tells them apart by content. A suffix that
        names the other format is allowed, with a warning."""
        path = Path(checkpoint)
        megabytes_to_bytes(size_per_shard)
        if shard:
            self.save_sharded_model(model, path, gather_dtensor, prefix, size_per_shard, use_safetensors, use_async)
            return
        _refuse_sharding_options(prefix, size_per_shard)
        if path.name.endswith(".index.json"):
            raise ValueError(
                f"{path}: an unsharded model file cannot be named *.index.json (loading would read it as the index "
                "of a sharded checkpoint); pass shard=True to write a sharded checkpoint"
            )
        _warn_on_contradicting_suffix(path, use_safetensors)
        self.save_unsharded_model(model, path, gather_dtensor, use_safetensors, use_async)

    def load_model(
        self, model: nn.Module, checkpoint: PathLike, strict: bool = True, *, verify: bool = False
    ) -> LoadResult:
        """Load weights into `model` from a file, an index file or a checkpoint directory.

        `verify=True` first compares every file with the checksum recorded when it was saved."""
        self._settle_async()
        path = _existing(checkpoint)
        with _verifying(verify):
            if path.is_dir() or path.name.endswith(".index.json"):
                return self.load_sharded_model(model, path, strict)
            return self.load_unsharded_model(model, path, strict)

    # ---- optimizer -----------------------------------------------------------------------------------------------
    def save_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: PathLike,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = DEFAULT_SIZE_PER_SHARD,
        use_async: bool = False,
    ) -> None:
        """Save optimizer state by parameter name: one `.safetensors` file, or (`shard=True`) a directory."""
        path = Path(checkpoint)
        megabytes_to_bytes(size_per_shard)
        if shard:
            self.save_sharded_optimizer(optimizer, path, gather_dtensor, prefix, size_per_shard, use_async)
            return
        _refuse_sharding_options(prefix, size_per_shard)
        if path.suffix in (".bin", ".pt", ".pth"):
            warnings.warn(
                f"{path.name}: this optimizer checkpoint holds cx's format (safetensors plus JSON, no pickle) "
                "whatever its suffix",
                stacklevel=2,
            )
        self.save_unsharded_optimizer(optimizer, path, gather_dtensor, use_async)

    def load_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: PathLike,
        prefix: str | None = None,
        *,
        verify: bool = False,
    ) -> None:
        """Load optimizer state from a `.safetensors` file, an index file or a checkpoint directory.

        `verify=True` first compares every file with the checksum recorded when it was saved."""
        self._settle_async()
        path = _existing(checkpoint)
        with _verifying(verify):
            if path.is_dir() or path.name.endswith(".index.json"):
                self.load_sharded_optimizer(optimizer, path, prefix)
                return
            if prefix:
                raise ValueError(
                    "prefix selects files inside a sharded optimizer checkpoint directory; got a single file"
                )
            self.load_unsharded_optimizer(optimizer, path)

    # ---- LR scheduler --------------------------------------------------------------------------------------------
    def save_lr_scheduler(self, lr_scheduler: Stateful, checkpoint: PathLike) -> None:
        """Write the scheduler's state as tagged JSON to the file `checkpoint`, atomically."""
        text = json.dumps({"format": _SCHEDULER_FORMAT, "state": encode(lr_scheduler.state_dict(), "lr_scheduler")})
        self._run(lambda: write_file_atomic(Path(checkpoint), lambda tmp: tmp.write_text(text)), False)

    def load_lr_scheduler(self, lr_scheduler: Stateful, checkpoint: PathLike) -> None:
        self._settle_async()
        path = _existing(checkpoint)
        data = parse_json(path.read_bytes(), str(path), CheckpointKindError, "the LR scheduler checkpoint (not JSON)")
        if not isinstance(data, dict) or data.get("format") != _SCHEDULER_FORMAT:
            raise CheckpointKindError(f"{path}: not a cx LR scheduler checkpoint (format is not {_SCHEDULER_FORMAT!r})")
        lr_scheduler.load_state_dict(decode(data["state"]))

    # ---- async ---------------------------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every asynchronous save of this CheckpointIO; re-raise the first error a writer hit."""
        self._async.synchronize()

    def queue_after_saves(self, job: Callable[[], None]) -> None:
        """Run `job` on the background writer once the asynchronous saves queued so far have finished, and only if
        they all succeeded (else it fails, with their error as its cause, and does nothing); its error is reported
        like theirs. For a caller that commits several asynchronous saves as one unit without waiting for them."""
        self._async.submit_after_success(job)

    def wait_for_writes(self) -> None:
        """Wait until this process's asynchronous saves have ended, raising nothing (their errors stay for
        `synchronize()`) and communicating with no other rank: for exit paths that must not leave a write running
        behind them (a lock on the folder released too early) yet cannot rely on the other ranks."""
        self._async.drain()

    def _settle_async(self, wait: bool = True) -> None:
        """Raise the error of an asynchronous save that failed, after waiting for the pending ones when `wait` (before
        every load; a plugin whose saves are collective overrides it to agree on the outcome across ranks)."""
        if wait:
            self._async.drain()
        self._async.raise_finished_failures()

    def _sync_d2h(self) -> None:
        """ColossalAI's name for waiting on the device-to-host copies of asynchronous saves: `synchronize()`."""
        self.synchronize()

    def _sync_io(self) -> None:
        """ColossalAI's name for waiting on asynchronous writes: `synchronize()`."""
        self.synchronize()

    def _run(self, job: Callable[[], None], use_async: bool) -> None:
        """Run a prepared save job now, or in the background writer when `use_async`.

        A synchronous job first waits for the queued asynchronous ones: otherwise an earlier async save to the same
        path would land after it (overwriting newer state with older) or have its staging removed mid-write. An
        earlier asynchronous save that failed is raised here, before this save starts."""
        if use_async:
            self._async.raise_finished_failures()
            self._async.submit(job)
        else:
            self._async.drain()
            self._async.raise_finished_failures()
            job()

    # ---- hooks ---------------------------------------------------------------------------------------------------
    @abstractmethod
    def save_unsharded_model(
        self, model: nn.Module, checkpoint: Path, gather_dtensor: bool, use_safetensors: bool, use_async: bool
    ) -> None: ...

    @abstractmethod
    def save_sharded_model(
        self,
        model: nn.Module,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_safetensors: bool,
        use_async: bool,
    ) -> None: ...

    @abstractmethod
    def load_unsharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult: ...

    @abstractmethod
    def load_sharded_model(self, model: nn.Module, checkpoint: Path, strict: bool) -> LoadResult: ...

    @abstractmethod
    def save_unsharded_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, gather_dtensor: bool, use_async: bool
    ) -> None: ...

    @abstractmethod
    def save_sharded_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        checkpoint: Path,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
    ) -> None: ...

    @abstractmethod
    def load_unsharded_optimizer(self, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None: ...

    @abstractmethod
    def load_sharded_optimizer(
        self, optimizer: torch.optim.Optimizer, checkpoint: Path, prefix: str | None
    ) -> None: ...


@contextlib.contextmanager
def _verifying(verify: bool) -> Iterator[None]:
    """Every `CheckpointReader.open` inside the block (also plugins' own) verifies checksums when `verify`."""
    token = VERIFY_BY_DEFAULT.set(verify)
    try:
        yield
    finally:
        VERIFY_BY_DEFAULT.reset(token)


def _existing(checkpoint: PathLike) -> Path:
    path = Path(checkpoint)
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint {path} does not exist")
    return path


def _warn_on_contradicting_suffix(path: Path, use_safetensors: bool) -> None:
    """A `.bin`/`.pt`/`.pth` name for a safetensors file, or `.safetensors` for a bin one, is written as asked but
    said: another tool reading by suffix would misread it (cx reads by content)."""
    bin_suffix = path.suffix in (".bin", ".pt", ".pth")
    if use_safetensors and bin_suffix:
        warnings.warn(
            f"{path.name}: written in safetensors format (use_safetensors=True) despite its {path.suffix} suffix",
            stacklevel=3,
        )
    elif not use_safetensors and path.suffix == ".safetensors":
        warnings.warn(
            f"{path.name}: written in the legacy bin (torch.save) format (use_safetensors=False) despite its "
            ".safetensors suffix",
            stacklevel=3,
        )


def _refuse_sharding_options(prefix: str | None, size_per_shard: float) -> None:
    """ColossalAI's scripts pass sharding options with `shard=False` too: accepted, and said to have no effect."""
    if prefix:
        warnings.warn(
            f"prefix={prefix!r} names the files of a sharded checkpoint (shard=True); this unsharded save writes the "
            "path given and ignores it",
            stacklevel=3,
        )
    if size_per_shard != DEFAULT_SIZE_PER_SHARD:
        warnings.warn(
            f"size_per_shard={size_per_shard} applies to sharded saves only; ignored with shard=False", stacklevel=3
        )
