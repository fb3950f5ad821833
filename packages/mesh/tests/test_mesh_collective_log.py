"""Each rank keeps a log of its last collectives (numbered per group), and a timed-out collective says which rank of
the group is behind and at which collective: from the positions the ranks publish in the store only once a wait is
slow or has failed."""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cx_mesh import (
    CollectiveTimeoutError,
    ProcessGroupMesh,
    all_gather_flat,
    all_reduce,
    last_collectives,
    record_collective,
    set_collective_recording,
)
from cx_mesh._collective_log import RING_SIZE
from cx_mesh._failures import default_store
from cx_mesh._peer_positions import POSITION_PREFIX
from cx_mesh.testing import distributed

_SHORT = timedelta(seconds=2)
_DP = r"group 'cx mesh \(2,\) along dp' \(ranks \[0, 1\]\)"
_OTHER = r"group 'cx mesh \(2,\) along other' \(ranks \[0, 1\]\)"


@distributed(world_size=2)
def test_collective_log_numbers_each_group_and_keeps_the_last_ones(rank: int, world_size: int) -> None:
    dp = ProcessGroupMesh(world_size, axis_names=("dp",)).get_group_along_axis("dp")
    other = ProcessGroupMesh(world_size, axis_names=("other",)).get_group_along_axis("other")
    for size in range(1, 21):
        all_reduce(torch.ones(size), group=dp)
    all_gather_flat(torch.empty(4, dtype=torch.bfloat16), torch.ones(2, dtype=torch.bfloat16), group=other)
    record_collective("gradient all-reduce in DDP backward", other)  # a phase whose collectives run inside torch
    records = last_collectives()
    assert len(records) == RING_SIZE == 16
    assert [r.describe() for r in records[-4:]] == [
        "#19 all-reduce (19 float32)",
        "#20 all-reduce (20 float32)",
        "#1 all-gather (2 bfloat16)",
        "#2 gradient all-reduce in DDP backward",
    ]
    assert records[-1].group == records[-2].group == other.group_name != records[-3].group == dp.group_name
    previous = set_collective_recording(False)
    try:
        all_reduce(torch.ones(1), group=dp)
        assert last_collectives() == records  # not recorded while off
    finally:
        set_collective_recording(previous)
    all_reduce(torch.ones(1), group=dp)
    assert last_collectives()[-1].describe() == "#21 all-reduce (1 float32)"


@distributed(world_size=2, timeout=60, fresh=True)  # timed-out gloo pairs are not reused by later tests
def test_timeout_names_the_rank_behind_and_its_last_collective(rank: int, world_size: int) -> None:
    dp = ProcessGroupMesh(world_size, axis_names=("dp",), timeout=_SHORT).get_group_along_axis("dp")
    other = ProcessGroupMesh(world_size, axis_names=("other",), timeout=_SHORT).get_group_along_axis("other")
    all_reduce(torch.ones(4), group=dp)  # #1 on dp, on both ranks
    if rank == 0:
        with pytest.raises(CollectiveTimeoutError) as raised:
            all_reduce(torch.ones(8), group=dp)  # #2: rank 1 skips it
        message = str(raised.value)
        assert re.search(
            "rank 1 is behind: its last collective on this group was #1 all-reduce \\(4 float32\\), this rank is "
            f"at #2 all-reduce \\(8 float32\\) \\(rank 1 (is waiting|timed out) in all-reduce on {_OTHER}\\)",
            message,
        ), message
        assert f"#2 all-reduce (8 float32) on {_DP.replace(chr(92), '')}" in message  # this rank's own log
    else:
        with pytest.raises(CollectiveTimeoutError) as raised:
            all_reduce(torch.ones(2), group=other)  # waits on another group instead
        message = str(raised.value)
        assert re.search(
            f"rank 0 has issued no collective on this group \\(rank 0 (is waiting|timed out) in all-reduce on {_DP}\\)",
            message,
        ), message
    assert message.startswith("all-reduce on group 'cx mesh (2,) along ")
    assert f"timed out after 0:00:02 on rank {rank}:" in message
    dist.barrier()


@distributed(world_size=2, timeout=60, fresh=True)  # reads the store's keys of this job alone
def test_a_slow_wait_publishes_its_position_and_withdraws_it(rank: int, world_size: int) -> None:
    store = default_store()
    assert store is not None
    group = ProcessGroupMesh(world_size, axis_names=("dp",)).get_group_along_axis("dp")
    key = f"{POSITION_PREFIX}0"
    if rank == 1:
        time.sleep(2.5)  # rank 0 waits past its first one-second poll slice
        published = json.loads(bytes(store.get(key)))
        assert re.fullmatch(f"is waiting in all-reduce on {_DP}", published["state"]), published
        assert published["groups"][group.group_name] == [1, "all-reduce", 3, "float32"]
    all_reduce(torch.ones(3), group=group)
    dist.barrier()
    assert not store.check([key])  # withdrawn once the wait completed
