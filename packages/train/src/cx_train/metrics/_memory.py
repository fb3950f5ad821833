"""Memory per rank for the progress line and the metrics: gathered from every rank at log steps (one all-gather of
two numbers). On CUDA the caching allocator's allocated and reserved bytes; on the CPU the process's resident set
(RSS), which is what a CPU run costs the machine (there is no allocator figure to report)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cx_mesh import all_gather_flat, get_accelerator

__all__ = ["MemorySample", "memory_per_rank"]


@dataclass(frozen=True)
class MemorySample:
    kind: str  # "rss" (CPU) or "cuda" (allocated / reserved)
    used: list[int]  # bytes per rank: RSS, or CUDA allocated
    reserved: list[int] | None  # bytes per rank reserved by the CUDA caching allocator (None on the CPU)

    def text(self) -> str:
        """`mem rss r0:312MiB ...` or `mem alloc/reserved r0:512/1024MiB ...`."""
        if self.reserved is None:
            return "mem rss " + " ".join(f"r{r}:{m / 2**20:.0f}MiB" for r, m in enumerate(self.used))
        pairs = zip(self.used, self.reserved, strict=True)
        return "mem alloc/reserved " + " ".join(
            f"r{r}:{a / 2**20:.0f}/{b / 2**20:.0f}MiB" for r, (a, b) in enumerate(pairs)
        )


def memory_per_rank() -> MemorySample:
    """Every rank's memory (collective: every rank calls it)."""
    accelerator = get_accelerator()
    device = accelerator.current_device()
    cuda = device.type == "cuda"
    reserved = torch.cuda.memory_reserved(device) if cuda else 0
    mine = torch.tensor([accelerator.memory_allocated(), reserved], dtype=torch.int64, device=device)
    everyone = torch.empty(2 * dist.get_world_size(), dtype=torch.int64, device=device)
    all_gather_flat(everyone, mine)
    values = [int(v) for v in everyone.cpu()]
    used, held = values[0::2], values[1::2]
    return MemorySample("cuda" if cuda else "rss", used, held if cuda else None)
