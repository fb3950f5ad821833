"""cx-mesh: the foundation every cx package stands on.

- `launch` / `launch_from_torch`: initialise torch.distributed (backend from the device, seeds, timeout; a rank that
  raises stops its peers at once).
- `named_collective` / `wait_named`: collectives whose timeout or failed peer is named (`CollectiveTimeoutError`,
  `PeerFailedError`); a timeout says which rank is behind, from each rank's log of its last collectives
  (`record_collective`, `last_collectives`).
- `get_accelerator`: the compute device (CUDA or CPU) behind one interface, with memory figures.
- `ProcessGroupMesh`: an N-d grid of ranks with cached process groups along its axes, and its torch DeviceMesh.
- `DistCoordinator`, `get_dist_logger`, `assert_same_across_ranks`.
The multi-process test harness lives in `cx_mesh.testing`.
"""

from cx_mesh._accelerator import (
    Accelerator,
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
    get_current_device,
    set_accelerator,
)
from cx_mesh._collective_log import (
    CollectiveRecord,
    last_collectives,
    record_collective,
    set_collective_recording,
)
from cx_mesh._collectives import (
    ProcessGroup,
    all_gather_flat,
    all_reduce,
    all_to_all_single,
    communication_device,
    reduce_scatter_flat,
    reduce_scatter_scratch_numel,
    require_initialized,
)
from cx_mesh._consistency import RankMismatchError, all_gather_bytes, assert_same_across_ranks
from cx_mesh._coordinator import DistCoordinator
from cx_mesh._failures import PeerFailedError, report_failure
from cx_mesh._group_names import describe_group
from cx_mesh._launch import DEFAULT_TIMEOUT, launch, launch_from_torch, set_seed
from cx_mesh._logging import DistLogger, disable_existing_loggers, get_dist_logger
from cx_mesh._process_group_mesh import Axis, ProcessGroupMesh
from cx_mesh._timeouts import CollectiveTimeoutError, collective_timeout, named_collective, wait_named

__all__ = [
    # launch
    "DEFAULT_TIMEOUT",
    "launch",
    "launch_from_torch",
    "set_seed",
    # device
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "get_accelerator",
    "get_current_device",
    "set_accelerator",
    # process groups
    "Axis",
    "ProcessGroup",
    "ProcessGroupMesh",
    "all_gather_flat",
    "all_reduce",
    "all_to_all_single",
    "communication_device",
    "reduce_scatter_flat",
    "reduce_scatter_scratch_numel",
    "require_initialized",
    # timeouts and failed peers
    "CollectiveTimeoutError",
    "PeerFailedError",
    "collective_timeout",
    "describe_group",
    "named_collective",
    "report_failure",
    "wait_named",
    # the collective log behind a timeout's report
    "CollectiveRecord",
    "last_collectives",
    "record_collective",
    "set_collective_recording",
    # coordination
    "DistCoordinator",
    "RankMismatchError",
    "all_gather_bytes",
    "assert_same_across_ranks",
    # logging
    "DistLogger",
    "disable_existing_loggers",
    "get_dist_logger",
]
