"""Fixed gradient buckets: each process group's parameters, in reverse registration order (roughly the order
backward produces their gradients), packed greedily into buckets of at most `reduce_bucket_size` padded elements
(a parameter larger than that forms a bucket of its own).

The plan depends only on the parameter shapes, so it is identical on every rank of the group; buckets are always
communicated in plan order. That is what keeps ranks whose backward skipped some parameters (unrouted experts,
untaken branches) from issuing different collectives and hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cx_zero._partition import ParamShard

__all__ = ["Bucket", "plan_buckets"]


@dataclass(eq=False)
class Bucket:
    """Parameters communicated together: bucket row r holds every parameter's slice r side by side."""

    shards: list[ParamShard]
    width: int
    ready: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.shards)


def plan_buckets(shards: Sequence[ParamShard], bucket_size: int) -> list[Bucket]:
    """Pack `shards` (already in communication order) into buckets; sets each shard's bucket index and offset."""
    buckets: list[Bucket] = []
    current: list[ParamShard] = []
    width = 0
    for shard in shards:
        padded = shard.shard_numel * shard.group_size
        if current and (width * shard.group_size + padded) > bucket_size:
            buckets.append(Bucket(current, width))
            current, width = [], 0
        shard.bucket = len(buckets)
        shard.offset = width
        current.append(shard)
        width += shard.shard_numel
    if current:
        buckets.append(Bucket(current, width))
    return buckets
