"""`--metrics FILE.jsonl`: one JSON object per log step, written by rank 0 and flushed line by line, so that a run
killed at any point leaves every line before it whole (and `tail -f` follows it).

A new run starts the file afresh; a resumed run (`--resume` at step k) keeps the lines up to step k and appends, so
the file holds each step once however often the run was stopped and resumed. A torn last line (a kill mid-write) is
dropped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO, Any

__all__ = ["MetricsFile", "read_metrics"]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The whole objects of a metrics file, in order (a torn or non-object line is skipped)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("step"), int):
            records.append(value)
    return records


class MetricsFile:
    def __init__(self, path: Path, resumed_step: int | None) -> None:
        self.path = path
        kept = [] if resumed_step is None or not path.is_file() else read_metrics(path)
        kept = [record for record in kept if record["step"] <= (resumed_step or 0)]
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.rewrite")
        scratch.write_text("".join(json.dumps(record) + "\n" for record in kept))
        os.replace(scratch, path)  # the kept lines, whole, even if this process dies now
        self._file: IO[str] = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
