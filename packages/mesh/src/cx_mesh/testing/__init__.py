"""Multi-process test harness for cx: `spawn` for fresh ranks, `@distributed` for pytest tests.

Every package's distributed tests use this. See docs/mesh.md for examples.
"""

from cx_mesh.testing._pool import shutdown_pools
from cx_mesh.testing._processes import DistributedTestFailure
from cx_mesh.testing._pytest import distributed
from cx_mesh.testing._spawn import DEFAULT_TIMEOUT_SECONDS, run_distributed, spawn

__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "DistributedTestFailure",
    "distributed",
    "run_distributed",
    "shutdown_pools",
    "spawn",
]
