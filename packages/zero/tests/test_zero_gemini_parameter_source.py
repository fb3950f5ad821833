"""`GeminiDDP(module, parameter_source=...)`: a module whose parameters (and buffers) are on the meta device is laid
out in chunks from its shapes and filled one parameter at a time from the source; the result equals the same model
built normally (every gathered value, and the forward against the eager model in one process). Bad sources get
clear errors on every rank."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, ParameterSource


def _model(device: str | None = None) -> nn.Sequential:
    torch.manual_seed(3)
    with torch.device(device) if device is not None else torch.device("cpu"):
        return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8), nn.BatchNorm1d(8))


class _FromTwin:
    """A source that takes values from an eagerly built twin, one fresh copy at a time, in reverse order; `skip`
    leaves one parameter out, `twice` gives one twice (both wrong)."""

    def __init__(self, lazy: nn.Module, twin: nn.Module, skip: int | None = None, twice: bool = False) -> None:
        self.pairs = list(zip(lazy.parameters(), twin.parameters(), strict=True))
        self.buffers = list(zip(lazy.named_modules(), twin.named_modules(), strict=True))
        self.skip, self.twice = skip, twice

    def stream(self, receive: Callable[[nn.Parameter, torch.Tensor], None]) -> None:
        for index, (param, value) in enumerate(reversed(self.pairs)):  # any order
            if index != self.skip:
                receive(param, value.detach().clone())
        if self.twice:
            receive(self.pairs[0][0], self.pairs[0][1].detach().clone())
        for (_, lazy_module), (_, twin_module) in self.buffers:
            for name, buffer in twin_module.named_buffers(recurse=False):
                setattr(lazy_module, name, buffer.clone())


@distributed(world_size=2)
def test_meta_parameters_are_filled_from_the_source(rank: int, world_size: int) -> None:
    twin, lazy = _model(), _model("meta")
    source = _FromTwin(lazy, twin)
    assert isinstance(source, ParameterSource)
    before = [id(p) for p in lazy.parameters()]
    ddp = GeminiDDP(lazy, mixed_precision=torch.float32, chunk_config_dict={"chunk_size": 128}, parameter_source=source)
    assert [id(p) for p in lazy.parameters()] == before  # the same parameter objects
    assert all(not p.is_meta for p in lazy.parameters())
    assert all(not b.is_meta for b in lazy.buffers())
    state = ddp.state_dict(only_rank_0=False)
    for name, value in twin.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    # and computes like it: the forward of the wrapped lazy model equals the eager twin's (a single process)
    data = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    ddp.eval()
    twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(ddp(data), twin(data), rtol=0, atol=0)


@distributed(world_size=1)
@pytest.mark.parametrize(
    ("fault", "message"),
    [("none", "meta device .* have no values"), ("skip", "gave no value to"), ("twice", "does not need \\(again\\)")],
)
def test_bad_sources_get_clear_errors(rank: int, world_size: int, fault: str, message: str) -> None:
    twin, lazy = _model(), _model("meta")
    skip = 0 if fault == "skip" else None
    source = None if fault == "none" else _FromTwin(lazy, twin, skip=skip, twice=fault == "twice")
    with pytest.raises(ValueError, match=message):
        GeminiDDP(lazy, mixed_precision=torch.float32, parameter_source=source)
