"""A measured expert-load histogram (`--expert-load FILE`): the tokens each expert of each MoE layer received, as
cx-train's `--metrics` file records them (`expert_counts`), turned into the hottest ep rank's share for each ep size.

`--routing-skew S` says how hot the hottest expert is and assumes every expert of its rank is as hot (the worst case
for that S). A histogram says which experts are hot together: cx-moe gives ep rank r the contiguous experts
[r E / ep, (r + 1) E / ep), so the hot rank's share at an ep size is max over layers of (its experts' tokens) / (the
mean rank's); that share is the candidate's `routing_skew` (`hot_rank_load` returns it unchanged: it is at most ep and
E / top_k by construction). Every MoE layer's histogram is kept: the worst layer sets the pace.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ExpertLoad", "read_expert_load"]


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert, one row per MoE layer, and where they came from."""

    counts: tuple[tuple[float, ...], ...]
    source: str

    @property
    def num_experts(self) -> int:
        return len(self.counts[0])

    def hot_rank_share(self, ep: int) -> float:
        """The busiest ep rank's tokens over the mean rank's, worst layer (1.0 without expert parallelism)."""
        if ep <= 1:
            return 1.0
        if self.num_experts % ep:
            raise ValueError(f"ep {ep} does not divide the {self.num_experts} experts of the expert load")
        per_rank = self.num_experts // ep
        worst = 1.0
        for layer in self.counts:
            total = sum(layer)
            if total <= 0:
                continue
            ranks = [sum(layer[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
            worst = max(worst, max(ranks) * ep / total)
        return worst

    def describe(self, eps: list[int]) -> str:
        shares = ", ".join(f"ep {ep} x{self.hot_rank_share(ep):.2f}" for ep in eps if ep > 1)
        return (
            f"expert load from {self.source} ({len(self.counts)} layers x {self.num_experts} experts): the hottest "
            f"ep rank's share {shares or '(no ep > 1 candidate)'}; the worst rank's memory and time"
        )


def _rows(value: Any, source: str) -> tuple[tuple[float, ...], ...]:
    """[[tokens per expert] per layer] from JSON, checked."""
    if not isinstance(value, list) or not value or not all(isinstance(row, list) and row for row in value):
        raise ValueError(f"{source}: expert_counts must be a non-empty list of per-layer lists of token counts")
    rows = tuple(tuple(float(x) for x in row) for row in value)
    if len({len(row) for row in rows}) != 1:
        raise ValueError(f"{source}: every layer must list the same number of experts, got {[len(r) for r in rows]}")
    if any(not math.isfinite(x) or x < 0 for row in rows for x in row):
        raise ValueError(f"{source}: token counts must be finite and >= 0")
    return rows


def read_expert_load(path: Path) -> ExpertLoad:
    """A cx-train `--metrics` JSONL file (the `expert_counts` of every record, summed: the run's histogram) or a JSON
    file holding `{"expert_counts": [[...], ...]}` or the bare list."""
    source = str(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ValueError(f"--expert-load {source}: cannot read it ({error.strerror})") from None
    if path.suffix == ".jsonl":
        total: list[list[float]] | None = None
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"--expert-load {source}: line {number} is not JSON") from None
            if not isinstance(record, dict) or "expert_counts" not in record:
                continue
            rows = _rows(record["expert_counts"], f"{source} line {number}")
            if total is None:
                total = [list(row) for row in rows]
            elif [len(r) for r in total] != [len(r) for r in rows]:
                raise ValueError(f"--expert-load {source}: line {number} has another layer / expert count")
            else:
                total = [[a + b for a, b in zip(t, r, strict=True)] for t, r in zip(total, rows, strict=True)]
        if total is None:
            raise ValueError(
                f"--expert-load {source}: no record has expert_counts (cx-train --metrics FILE.jsonl writes them at "
                "every log step for an MoE model whose router logits transformers returns; DeepSeek-V3's does not)"
            )
        return ExpertLoad(tuple(tuple(row) for row in total), source)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"--expert-load {source}: not JSON (a .jsonl is read as cx-train's metrics)") from None
    rows = _rows(value.get("expert_counts") if isinstance(value, dict) else value, f"--expert-load {source}")
    return ExpertLoad(rows, source)
