"""`cx_mesh.testing.seed_all`, ColossalAI's `colossalai.testing.seed_all`: every generator a test draws from is
seeded, and `cuda_deterministic=True` sets cuDNN's flags."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Iterator

import pytest
import torch

from cx_mesh.testing import seed_all


def _draws() -> list[float]:
    values = [random.random(), *torch.rand(3).tolist()]
    if importlib.util.find_spec("numpy") is not None:
        import numpy

        values.append(float(numpy.random.rand()))
    if torch.cuda.is_available():
        values.extend(torch.rand(3, device="cuda").tolist())
    return values


def test_seed_all_seeds_every_generator() -> None:
    seed_all(1234)
    first = _draws()
    seed_all(1234)
    assert _draws() == first
    seed_all(4321)
    assert _draws() != first
    random.seed(1234)
    torch.manual_seed(1234)
    assert first[:4] == [random.random(), *torch.rand(3).tolist()]  # the same seed as the generators' own calls


@pytest.fixture
def cudnn_flags() -> Iterator[None]:
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


@pytest.mark.usefixtures("cudnn_flags")
def test_seed_all_cuda_deterministic() -> None:
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
    seed_all(0)  # ColossalAI's positional signature; False leaves the flags alone
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)
    seed_all(0, cuda_deterministic=True)
    assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (True, False)
