"""`get_dist_logger()`: standard `logging` that knows the rank and can speak from chosen ranks only."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

import torch.distributed as dist

__all__ = ["DistLogger", "get_dist_logger"]

_FORMAT = "%(asctime)s [rank %(rank)s] %(levelname)s %(name)s: %(message)s"


def _current_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _RankFilter(logging.Filter):
    """Stamps every record with the process's global rank (`record.rank`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = _current_rank()
        return True


class _CxHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one stderr handler cx installs; recognised by type so it is never added twice."""


class DistLogger:
    """A thin wrapper over a `logging.Logger`; every method accepts `ranks=[...]` to log on those ranks only."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def _log(self, level: int, message: str, ranks: Iterable[int] | None) -> None:
        if ranks is None or _current_rank() in set(ranks):
            self.logger.log(level, message, stacklevel=3)

    def debug(self, message: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.DEBUG, message, ranks)

    def info(self, message: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.INFO, message, ranks)

    def warning(self, message: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.WARNING, message, ranks)

    def error(self, message: str, ranks: Iterable[int] | None = None) -> None:
        self._log(logging.ERROR, message, ranks)

    def set_level(self, level: int | str) -> None:
        self.logger.setLevel(level)


def get_dist_logger(name: str = "cx", level: int | str = logging.INFO) -> DistLogger:
    """The rank-aware logger called `name`; calling again never adds a second handler."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    if not any(isinstance(h, _CxHandler) for h in logger.handlers):
        handler = _CxHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        logger.addHandler(handler)
        logger.propagate = False
        logger.setLevel(level)
    return DistLogger(logger)


def disable_existing_loggers(include: Iterable[str] | None = None, exclude: Iterable[str] = ("cx",)) -> None:
    """Raise the loggers that exist now (or only those in `include`) to ERROR, except those in `exclude`.

    ColossalAI scripts call this first to silence chatty libraries; cx's own loggers are spared by default.
    """
    names = list(include) if include is not None else list(logging.root.manager.loggerDict)
    spared = set(exclude)
    for name in names:
        if name not in spared and not any(name.startswith(f"{prefix}.") for prefix in spared):
            logging.getLogger(name).setLevel(logging.ERROR)
