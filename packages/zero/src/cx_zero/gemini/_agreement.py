"""Whether the ranks of each check group reported the same digest, kept on the device until read (issue 37).

GeminiDriver compares the ranks' reports (parameters used, chunk collective order) at the end of every forward and
backward with one all-gather of a digest. The comparison stays on the device; its answer is read on the first
`FIRST_READS` checks (a mismatch there is named at the check that saw it, as before) and then on every
`READ_EVERY`-th, so the usual step reads nothing on the host. The reports since the last read are kept, so a
mismatch found later is still named by the report of the check that saw it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cx_mesh import ProcessGroup, all_gather_flat, communication_device

__all__ = ["FIRST_READS", "READ_EVERY", "Disagreement", "DigestAgreement"]

FIRST_READS = 6  # three training steps: each checks at the end of its forward and of its backward
READ_EVERY = 16  # two checks a step (forward, backward): one host read per 8 steps, a mismatch named within a few


@dataclass(frozen=True)
class Disagreement:
    """The first check since the last read whose digests differed over `group`: its phase and this rank's report."""

    group: ProcessGroup | None
    phase: str
    payload: bytes
    checks_ago: int


@dataclass
class _Pending:
    reports: list[tuple[str, bytes]] = field(default_factory=list)
    first_bad: torch.Tensor | None = None  # 1 + the index in `reports` of the first mismatch (0: none)


class DigestAgreement:
    """Per check group: the reports since the last read and, on the device, the first one that disagreed."""

    def __init__(self, groups: list[ProcessGroup | None]) -> None:
        self.groups = groups
        self.checks = 0
        self._pending = [_Pending() for _ in groups]

    def compare(self, index: int, digest: bytes, payload: bytes, phase: str) -> None:
        """One all-gather of `digest` over group `index`; whether it matched stays on the device."""
        group, pending = self.groups[index], self._pending[index]
        device = communication_device(group)
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
        size = torch.distributed.get_world_size(group)
        gathered = torch.empty(len(digest) * size, dtype=torch.uint8, device=device)
        all_gather_flat(gathered, mine, group)
        rows = gathered.view(-1, len(digest))
        pending.reports.append((phase, payload))
        first = pending.first_bad if pending.first_bad is not None else torch.zeros((), device=device)
        pending.first_bad = first + ((rows != rows[0]).any() & (first == 0)) * len(pending.reports)

    def end_check(self) -> Disagreement | None:
        """Count a check; when it is a read one, the first disagreement since the last read (None: all agreed)."""
        self.checks += 1
        if self.checks > FIRST_READS and self.checks % READ_EVERY != 0:
            return None
        flagged = [(i, p) for i, p in enumerate(self._pending) if p.first_bad is not None]
        firsts = torch.stack([p.first_bad for _, p in flagged if p.first_bad is not None]).tolist() if flagged else []
        found = None
        for (index, pending), first in zip(flagged, firsts, strict=True):
            if first and found is None:
                phase, payload = pending.reports[int(first) - 1]
                found = Disagreement(self.groups[index], phase, payload, len(pending.reports) - int(first))
        self._pending = [_Pending() for _ in self.groups]
        return found
