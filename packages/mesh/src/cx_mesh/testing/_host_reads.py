"""`count_host_reads`: which cx code reads tensor values on the host, for tests that hold the training hot path to
no device-to-host synchronisation (issue 37).

Every call of a reading method (`item`, `tolist`, `__bool__`, `__float__`, `__int__`, `numpy`, `cpu`) is recorded
under the module and function that made it: the frame directly above the call, so a read torch makes on cx's behalf
(AdamW reading its CPU step counter) is torch's, not cx's. On CPU no read really waits for a device, so the count is
a proxy: each counted call would be a synchronisation on an accelerator.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["HostReads", "READING_METHODS", "count_host_reads"]

READING_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")


@dataclass
class HostReads:
    """Calls per "module:function (method)" while the context was open, and whether counting is on."""

    by_site: collections.Counter[str] = field(default_factory=collections.Counter)
    counting: bool = True

    def cx(self, exempt: tuple[str, ...] = ()) -> dict[str, int]:
        """The reads made by cx modules (`cx_*`), less the sites that start with one of `exempt`."""
        return {
            site: n
            for site, n in self.by_site.items()
            if site.startswith("cx_") and not site.startswith(exempt) and not site.startswith("cx_mesh.testing")
        }

    def clear(self) -> None:
        self.by_site.clear()


def _recording(method: str, original: Callable[..., Any], reads: HostReads) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if reads.counting:
            caller = sys._getframe(1)
            module = caller.f_globals.get("__name__", "?")
            reads.by_site[f"{module}:{caller.f_code.co_name} ({method})"] += 1
        return original(self, *args, **kwargs)

    return wrapper


@contextlib.contextmanager
def count_host_reads(methods: tuple[str, ...] = READING_METHODS) -> Iterator[HostReads]:
    """Record every host read of a tensor's value while open (module doc); `HostReads.counting` pauses it."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in methods}
    for name, original in originals.items():
        setattr(torch.Tensor, name, _recording(name, original, reads))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
