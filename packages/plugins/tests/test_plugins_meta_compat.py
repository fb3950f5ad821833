"""`cx_plugins.is_compatible_with_meta`, ColossalAI's guard for lazy-initialisation tests: True where the meta
device runs tensor ops (so a model built under `LazyInitContext` holds meta tensors), False where it does not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from cx_plugins import LazyInitContext, is_compatible_with_meta


@pytest.mark.skipif(not is_compatible_with_meta(), reason="ColossalAI's guard, as its lazy-init tests use it")
def test_is_compatible_with_meta_where_lazy_init_builds_on_meta() -> None:
    assert is_compatible_with_meta() is True
    with LazyInitContext():
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    assert all(p.is_meta for p in model.parameters())
    LazyInitContext.materialize(model)
    assert not any(p.is_meta for p in model.parameters())


def test_is_compatible_with_meta_is_false_when_meta_ops_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_meta(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("no meta kernels in this torch")

    monkeypatch.setattr(torch, "empty", no_meta)
    assert is_compatible_with_meta() is False
