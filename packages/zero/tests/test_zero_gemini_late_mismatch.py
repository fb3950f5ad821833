"""Gemini's path check after its first reads (issue 37): the digest comparison stays on the device and is read on
the first 3 steps, then every `READ_EVERY` checks. A mismatch after the first steps is named at the next read by the
report of the check that saw it, and says how many checks later it was found."""

from __future__ import annotations

import pytest
import torch

from cx_mesh.testing import count_host_reads, distributed
from cx_zero.gemini import GeminiDDP, PathMismatchError, _agreement
from zero_gemini_rough_models import BLOCK_NUMEL, DIM, build_stack


@distributed(world_size=2)
def test_zero_gemini_late_order_mismatch_is_named_at_the_next_read(rank: int, world_size: int) -> None:
    """Chunks kept gathered (strict_ddp_mode): a different module order pairs same-size all-reduces of different
    chunks in backward, which runs on silently; step 4's backward (check 8) is read at check 10 (step 5's)."""
    every = _agreement.READ_EVERY
    _agreement.READ_EVERY = 10
    try:
        ddp = GeminiDDP(
            build_stack(),
            chunk_config_dict={"chunk_size": BLOCK_NUMEL},
            mixed_precision=torch.float32,
            strict_ddp_mode=True,
        )
        x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(rank))
        with count_host_reads() as reads:
            for step in range(1, 5):
                if step == 4:
                    reads.clear()
                ddp.backward(ddp(x, order=(0, 1, 2) if step < 4 or rank == 0 else (2, 1, 0)).sum())
                ddp.zero_grad()
            late = {site: n for site, n in reads.cx().items() if site.startswith("cx_zero.gemini")}
        assert late == {}, f"step 4 reads nothing on the host: {late}"
        out = ddp(x, order=(0, 1, 2))
        with pytest.raises(PathMismatchError, match=r"different order in backward.*\(found 2 check\(s\) later\)"):
            ddp.backward(out.sum())
    finally:
        _agreement.READ_EVERY = every
