"""The one rule for `fp8_communication` where a plugin has no collective to compress (every plugin calls it).

On one rank there is no gradient reduction, parameter gather, TP collective or pipeline p2p to send in fp8 (the
cx_mesh.fp8 collectives copy exactly for a group of one). A one-rank debug run of a multi-rank config should run, so
this is neither an error nor silent: one UserWarning names the switch and says there is nothing to compress.
"""

from __future__ import annotations

import warnings

__all__ = ["warn_if_nothing_to_compress"]


def warn_if_nothing_to_compress(owner: str, fp8_communication: bool, ranks: int, stacklevel: int = 2) -> None:
    """Warn once, naming `owner`'s switch, when `fp8_communication` is on and the plugin's collectives span `ranks`
    == 1 rank. `stacklevel` counts from the caller of this function (2: the caller's caller, the user's code)."""
    if fp8_communication and ranks == 1:
        warnings.warn(
            f"{owner}(fp8_communication=True): nothing to compress on a single rank (no collective or p2p runs); "
            "training proceeds without fp8 communication",
            UserWarning,
            stacklevel=stacklevel + 1,
        )
