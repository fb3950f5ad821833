"""One small interface over the compute device, so the rest of cx never branches on CUDA vs CPU.

`get_accelerator()` returns the CUDA implementation when CUDA is available, the CPU one otherwise. Memory figures on
CPU come from the process (resident set size and its peak, from /proc and `resource`) and the machine's physical
memory; any accelerator's capacity can be overridden with an explicit byte budget so that memory policies can be
exercised and tested on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "get_current_device",
    "set_accelerator",
]


class Accelerator(ABC):
    """The compute device of this process: identity, synchronisation, memory figures and streams."""

    def __init__(self) -> None:
        self._capacity_override: int | None = None

    @property
    @abstractmethod
    def name(self) -> str:
        """Device type string as torch spells it ("cuda", "cpu")."""

    @property
    @abstractmethod
    def communication_backend(self) -> str:
        """The torch.distributed backend that suits this device ("nccl", "gloo")."""

    @abstractmethod
    def current_device(self) -> torch.device: ...

    @abstractmethod
    def set_device(self, index: int) -> None: ...

    @abstractmethod
    def device_count(self) -> int: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def memory_allocated(self) -> int:
        """Bytes currently in use on the device (on CPU: the process's resident set size)."""

    @abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak bytes in use since start or the last `reset_peak_memory_stats` (on CPU: peak RSS)."""

    @abstractmethod
    def reset_peak_memory_stats(self) -> None: ...

    @abstractmethod
    def _physical_capacity(self) -> int: ...

    @abstractmethod
    def is_pin_memory_available(self) -> bool:
        """Whether host tensors can be page-locked for faster, asynchronous copies to this device."""

    @abstractmethod
    def stream(self) -> contextlib.AbstractContextManager[object]:
        """A context that runs work on a side stream (a no-op on devices without streams)."""

    def is_available(self) -> bool:
        """Whether this device can run work in this process (ColossalAI scripts gate fused kernels on it)."""
        return self.device_count() > 0

    def get_current_device(self) -> torch.device:
        """ColossalAI's spelling of `current_device()`."""
        return self.current_device()

    def manual_seed(self, seed: int) -> None:
        """Seed this device's generators (all of them for CUDA; the CPU generator on CPU)."""
        torch.manual_seed(seed)

    def empty_cache(self) -> None:
        """Return cached, unused device memory to the system (nothing is cached on CPU)."""
        return None

    def total_memory(self) -> int:
        """Bytes the device offers: the override from `set_memory_capacity`, else the physical capacity."""
        if self._capacity_override is not None:
            return self._capacity_override
        return self._physical_capacity()

    def set_memory_capacity(self, nbytes: int | None) -> None:
        """Pretend the device has `nbytes` (None restores the physical figure). Used by placement policies' tests."""
        if nbytes is not None and nbytes <= 0:
            raise ValueError(f"memory capacity must be a positive number of bytes, got {nbytes}")
        self._capacity_override = nbytes


class CpuAccelerator(Accelerator):
    """The host CPU as compute device; memory figures are the process's own (documented above)."""

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def communication_backend(self) -> str:
        return "gloo"

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        """CPU has a single device; any index is accepted so launch code stays device-agnostic."""

    def device_count(self) -> int:
        return 1

    def synchronize(self) -> None:
        """CPU kernels are synchronous."""

    def memory_allocated(self) -> int:
        try:
            with open("/proc/self/statm") as statm:
                pages = int(statm.read().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return self.max_memory_allocated()

    def max_memory_allocated(self) -> int:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # ru_maxrss is KiB on Linux, bytes on macOS.
        peak_bytes = peak if sys.platform == "darwin" else peak * 1024
        return max(peak_bytes, self.memory_allocated())

    def reset_peak_memory_stats(self) -> None:
        """The operating system's peak RSS cannot be reset: on CPU the peak is the process lifetime's."""

    def _physical_capacity(self) -> int:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    def is_pin_memory_available(self) -> bool:
        return False

    @contextlib.contextmanager
    def _null_stream(self) -> Iterator[object]:
        yield None

    def stream(self) -> contextlib.AbstractContextManager[object]:
        return self._null_stream()


class CudaAccelerator(Accelerator):
    """An NVIDIA (or ROCm) GPU through torch.cuda."""

    @property
    def name(self) -> str:
        return "cuda"

    @property
    def communication_backend(self) -> str:
        return "nccl"

    def current_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated()

    def reset_peak_memory_stats(self) -> None:
        torch.cuda.reset_peak_memory_stats()

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def _physical_capacity(self) -> int:
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)

    def is_pin_memory_available(self) -> bool:
        return True

    def stream(self) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(torch.cuda.Stream())


_ACCELERATOR: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The process-wide accelerator: CUDA when available, else CPU (override with `set_accelerator`)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = CudaAccelerator() if torch.cuda.is_available() else CpuAccelerator()
    return _ACCELERATOR


def get_current_device() -> torch.device:
    """The device this process computes on (ColossalAI's `colossalai.utils.get_current_device`)."""
    return get_accelerator().current_device()


def set_accelerator(kind: str | Accelerator) -> Accelerator:
    """Force the accelerator ("cpu", "cuda" or an instance), e.g. to run CPU tests on a GPU machine."""
    global _ACCELERATOR
    if isinstance(kind, Accelerator):
        _ACCELERATOR = kind
    elif kind == "cpu":
        _ACCELERATOR = CpuAccelerator()
    elif kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("set_accelerator('cuda'): CUDA is not available in this process")
        _ACCELERATOR = CudaAccelerator()
    else:
        raise ValueError(f"unknown accelerator {kind!r}; expected 'cpu', 'cuda' or an Accelerator instance")
    return _ACCELERATOR
