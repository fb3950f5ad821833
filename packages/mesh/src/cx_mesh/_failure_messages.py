"""The text of a named collective's errors: the operation, the group, this rank, and (for a timeout) where the other
ranks are and this rank's last collectives, so that the message says which rank is behind and where.

Each error first publishes this rank's position in the store (`_peer_positions`), so that peers timing out at the same
moment can read it; only a timeout then reads the peers' positions, since it is the case where a rank is stuck.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from cx_mesh._collective_log import group_description, last_collectives
from cx_mesh._group_names import describe_group, group_ranks
from cx_mesh._peer_positions import publish_position, where_ranks_are

__all__ = ["peer_failed_message", "peer_gone_message", "timed_out_message"]

_INDENT = "\n  "


def peer_failed_message(what: str, group: dist.ProcessGroup | None, failed: str) -> str:
    """A peer recorded its failure (`failed`: "rank N raised Type: message") while this rank waited in `what`."""
    described = describe_group(group)
    publish_position(f"stopped in {what} on {described}: {failed}")
    return (
        f"{what} on {described} cannot complete: {failed} (its traceback is in its own output); this rank "
        f"(rank {dist.get_rank()}) stops too"
    )


def peer_gone_message(what: str, group: dist.ProcessGroup | None, error: BaseException) -> str:
    """A peer's connection closed with no failure recorded (a rank killed, or ended by `os._exit`)."""
    described = describe_group(group)
    publish_position(f"stopped in {what} on {described}: a peer's connection closed")
    me = dist.get_rank()
    others = [rank for rank in group_ranks(group) if rank != me]
    who = f"rank {others[0]}, the other rank of this group," if len(others) == 1 else "a rank of this group"
    return (
        f"{what} on {described} failed on rank {me}: {who} ended (its connection closed) without recording an "
        f"error; see that rank's own output. Backend said: {error}"
    )


def timed_out_message(what: str, group: dist.ProcessGroup | None, timeout: timedelta, error: BaseException) -> str:
    """`what` ran out of `timeout`: the peers' positions against this rank's, then this rank's last collectives."""
    described = describe_group(group)
    publish_position(f"timed out in {what} on {described}")
    lines = [
        f"{what} on {described} timed out after {timeout} on rank {dist.get_rank()}: a rank of this group is "
        "stuck or running a different collective (ranks out of step)",
        *where_ranks_are(group),
    ]
    records = last_collectives()
    if records:
        lines.append("this rank's last collectives, oldest first:")
        lines += [f"  {record.describe()} on {group_description(record.group)}" for record in records]
    lines.append(f"Backend said: {error}")
    return _INDENT.join(lines)
