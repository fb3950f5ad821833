"""`seed_all(seed, cuda_deterministic=False)`, ColossalAI's `colossalai.testing.seed_all`: one call seeds every
generator a test draws from (Python's `random`, NumPy's when NumPy is installed, torch's CPU and CUDA generators), so
a test ported from ColossalAI keeps its seeding line with only the import changed."""

from __future__ import annotations

import importlib.util
import random

import torch

__all__ = ["seed_all"]


def seed_all(seed: int, cuda_deterministic: bool = False) -> None:
    """Seed Python's `random`, NumPy (if installed), torch and every CUDA device (if present) with `seed`.

    `cuda_deterministic=True` also makes cuDNN deterministic (`deterministic=True`, `benchmark=False`), as in
    ColossalAI. With False the cuDNN flags are left as they are: ColossalAI turns `benchmark` on there, a
    process-wide side effect that would leak into the tests sharing a worker process."""
    random.seed(seed)
    if importlib.util.find_spec("numpy") is not None:  # cx-mesh does not depend on NumPy
        import numpy

        numpy.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # torch.manual_seed does this too; said here, as ColossalAI says it
    if cuda_deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
