"""cx-train's flags for an elastic launch across machines (`--nnodes MIN:MAX`, `--rdzv-endpoint`, `--rdzv-id`,
`--rdzv-conf`), as one argument group of `_parser`'s parser, validated into one `Rendezvous`.

Without `--nnodes` cx-train starts its `--nproc` ranks on this machine alone (torchrun's `--standalone`). With it,
cx-train's launcher runs torchrun's elastic agent with the c10d rendezvous: one `cx-train` per machine, every one with
the same flags, and a restart (`--max-restarts`) may come back with any node count in MIN..MAX (a lost machine, or
one that joins); the ranks then resume from `--save` at the new data-parallel size (`checkpoint._restart`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["Rendezvous", "add_launch_arguments", "rendezvous_of"]


@dataclass(frozen=True)
class Rendezvous:
    """torchrun's elastic rendezvous for a launch over several machines."""

    min_nodes: int
    max_nodes: int
    endpoint: str  # HOST:PORT of the c10d store (the machine whose host name matches hosts it)
    run_id: str  # the same on every machine of one job
    conf: str = ""  # torchrun's --rdzv-conf, e.g. "last_call_timeout=5,join_timeout=600"

    @property
    def nnodes(self) -> str:
        return str(self.min_nodes) if self.min_nodes == self.max_nodes else f"{self.min_nodes}:{self.max_nodes}"

    def torchrun_arguments(self) -> list[str]:
        """What replaces `--standalone` on torchrun's command line."""
        arguments = ["--nnodes", self.nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint]
        arguments += ["--rdzv-id", self.run_id]
        return arguments + (["--rdzv-conf", self.conf] if self.conf else [])


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    launch = parser.add_argument_group("launch across machines (torchrun's elastic rendezvous)")
    launch.add_argument(
        "--nnodes",
        default=None,
        metavar="N or MIN:MAX",
        help="machines in the job, each running this cx-train with the same flags; MIN:MAX lets a restart "
        "(--max-restarts) come back with fewer or more machines, resuming at the new data-parallel size "
        "(default: this machine alone)",
    )
    launch.add_argument(
        "--rdzv-endpoint", default=None, metavar="HOST:PORT", help="where the machines meet (needs --nnodes)"
    )
    launch.add_argument("--rdzv-id", default="cx-train", help="the job's name, the same on every machine")
    launch.add_argument(
        "--rdzv-conf",
        default="",
        metavar="KEY=VALUE,...",
        help="torchrun's rendezvous settings, e.g. last_call_timeout=5 (seconds a restart waits for more "
        "machines once MIN are there) (default: torchrun's)",
    )


def _node_counts(text: str) -> tuple[int, int] | None:
    low, _, high = text.partition(":")
    try:
        counts = int(low), int(high or low)
    except ValueError:
        return None
    return counts if 1 <= counts[0] <= counts[1] else None


def rendezvous_of(args: argparse.Namespace) -> Rendezvous | str | None:
    """The launch flags as a `Rendezvous` (None: this machine alone), or what is wrong with them."""
    if args.nnodes is None:
        given = "--rdzv-endpoint" if args.rdzv_endpoint else "--rdzv-conf" if args.rdzv_conf else None
        return None if given is None else f"{given} needs --nnodes (a launch across machines)"
    counts = _node_counts(str(args.nnodes))
    if counts is None:
        return f"--nnodes {args.nnodes}: give a node count N or MIN:MAX with 1 <= MIN <= MAX (e.g. 1:2)"
    endpoint = args.rdzv_endpoint
    host, _, port = (endpoint or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"--nnodes needs --rdzv-endpoint HOST:PORT, where the machines meet (got {endpoint!r})"
    if not args.rdzv_id:
        return "--rdzv-id must not be empty"
    return Rendezvous(counts[0], counts[1], endpoint, args.rdzv_id, args.rdzv_conf)
