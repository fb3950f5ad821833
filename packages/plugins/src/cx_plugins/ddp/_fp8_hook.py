"""The fp8 gradient all-reduce for torch DDP (`fp8_communication=True`), as ColossalAI's fp8 DDP comm hook.

Each gradient bucket is averaged over the group with `cx_mesh.fp8.all_reduce_fp8_segments` in E5M2 (gradients need
the range): an fp8 reduce-scatter with one scale per parameter and destination slice, float32 sums, then an fp8
all-gather of the reduced slices, so every replica ends with the same values and about half the bytes of a bf16
all-reduce move. Scaling per parameter (ColossalAI's hook scales the whole bucket) makes each gradient's rounding
independent of the bucket it lies in: DDP rebuilds its buckets in gradient-ready order after the first iteration,
so a resumed run's first steps see other buckets than the straight run's, and with bucket-wide scales the resume
was not bit-exact.
Only TorchDDPPlugin registers it (`register_fp8_comm_hook`), so it lives in ddp/; the hybrid plugins' zero_stage 0
has no torch DDP and averages in fp8 in its own optimizer.
"""

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # dist.GradBucket, which mypy cannot see through dist
from torch.nn.parallel import DistributedDataParallel

from cx_mesh.fp8 import E5M2, all_reduce_fp8_segments

__all__ = ["fp8_all_reduce_hook", "register_fp8_comm_hook"]


def fp8_all_reduce_hook(group: dist.ProcessGroup | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: average `bucket`'s flat gradients over `group` (None: the world) in place, in fp8. DDP
    checks the annotations at run time, so this module does not postpone them (no `from __future__ import`).

    The exchange runs to completion inside the hook (the compressed all-reduce is two collectives with a float32
    sum between them), and the returned future is already done; DDP copies the averaged buffer into the grads. The
    bucket's gradients lie back to back in its buffer, in `bucket.gradients()` order: one segment each."""
    buffer = bucket.buffer()
    lengths = [gradient.numel() for gradient in bucket.gradients()]
    all_reduce_fp8_segments(buffer, lengths, op=dist.ReduceOp.AVG, group=group, fp8_dtype=E5M2)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def register_fp8_comm_hook(model: DistributedDataParallel, group: dist.ProcessGroup | None = None) -> None:
    """Make `model` all-reduce its gradient buckets in fp8 over `group` (DDP's own process group; None: the world).
    DDP accepts one comm hook per model, registered before the first backward."""
    model.register_comm_hook(group, fp8_all_reduce_hook)
