"""Multi-process test harness for cx: `spawn` for fresh ranks, `@distributed` for pytest tests.

Every package's distributed tests use this. See docs/mesh.md for examples. ColossalAI's `colossalai.testing` helpers
(`parameterize`, `rerun_if_address_is_in_use`, `clear_cache_before_run`, `spawn(func, nprocs)`,
`check_state_dict_equal`, `assert_close_loose`, `free_port`, `seed_all`) are here too, so its tests move by changing
imports. Tolerances for comparing a parallel run with one process follow from the arithmetic (`sum_tolerance`,
`adam_parameter_tolerance`, `TEST_ADAM_EPS`; the derivation is in `_tolerances`). `count_collective_bytes` counts
the bytes each collective is handed (what the fp8 tests check); `count_host_reads` counts the tensor reads each cx
module makes on the host (the hot path makes none).
"""

from cx_mesh.testing._bytes import CollectiveBytes, count_collective_bytes
from cx_mesh.testing._colossalai import (
    assert_close_loose,
    check_state_dict_equal,
    clear_cache_before_run,
    free_port,
    parameterize,
    rerun_if_address_is_in_use,
)
from cx_mesh.testing._host_reads import READING_METHODS, HostReads, count_host_reads
from cx_mesh.testing._per_test import PerTestCache
from cx_mesh.testing._pool import shutdown_pools
from cx_mesh.testing._processes import DistributedTestFailure
from cx_mesh.testing._pytest import distributed
from cx_mesh.testing._seeding import seed_all
from cx_mesh.testing._spawn import DEFAULT_TIMEOUT_SECONDS, default_timeout, run_distributed, spawn
from cx_mesh.testing._tolerances import (
    TEST_ADAM_EPS,
    adam_parameter_tolerance,
    adam_step_tolerance,
    sum_tolerance,
    tiny_model_adam_tolerance,
    unit_roundoff,
)

__all__ = [
    "CollectiveBytes",
    "DEFAULT_TIMEOUT_SECONDS",
    "default_timeout",
    "DistributedTestFailure",
    "HostReads",
    "READING_METHODS",
    "TEST_ADAM_EPS",
    "PerTestCache",
    "adam_parameter_tolerance",
    "adam_step_tolerance",
    "assert_close_loose",
    "check_state_dict_equal",
    "clear_cache_before_run",
    "count_collective_bytes",
    "count_host_reads",
    "distributed",
    "free_port",
    "parameterize",
    "rerun_if_address_is_in_use",
    "run_distributed",
    "seed_all",
    "shutdown_pools",
    "spawn",
    "sum_tolerance",
    "tiny_model_adam_tolerance",
    "unit_roundoff",
]
