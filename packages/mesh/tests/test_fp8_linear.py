"""Fp8Linear and convert_to_fp8: which layers are swapped, and that a swapped layer computes fp8_linear with the same
parameters and state_dict; fp8_eligible and Fp8Options' checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from cx_mesh.fp8 import Fp8Linear, Fp8Options, ScalingRecipe, convert_to_fp8, fp8_eligible, fp8_linear


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32, bias=False)
        self.odd = nn.Linear(32, 24)  # 24 is not a multiple of 16: stays high precision
        self.small = nn.Linear(32, 16)
        self.lm_head = nn.Linear(32, 64)  # excluded by default

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lm_head(self.down(self.up(x)))
        return out


def test_fp8_convert_swaps_eligible_plain_linears_only_and_is_idempotent() -> None:
    model = _Tiny()
    keys = {k: v.clone() for k, v in model.state_dict().items()}
    converted = convert_to_fp8(model, Fp8Options(min_features=32))
    assert converted == ["up", "down"]
    assert type(model.up) is Fp8Linear
    assert [type(m) for m in (model.small, model.odd, model.lm_head)] == [nn.Linear] * 3
    assert convert_to_fp8(model, Fp8Options(min_features=32)) == []  # already converted
    state = model.state_dict()
    assert state.keys() == keys.keys()
    assert all(torch.equal(state[k], keys[k]) for k in keys)
    x = torch.randn(2, 5, 32)
    expected = fp8_linear(x, model.up.weight, model.up.bias)
    assert torch.equal(model.up(x), expected)
    assert convert_to_fp8(model, Fp8Options(exclude=())) == ["small", "lm_head"]
    rowwise = nn.Linear(32, 32)
    assert convert_to_fp8(rowwise, Fp8Options(recipe=ScalingRecipe.ROWWISE)) == [""]
    assert isinstance(rowwise, Fp8Linear)
    assert rowwise.recipe is ScalingRecipe.ROWWISE
    assert torch.equal(rowwise(x), fp8_linear(x, rowwise.weight, rowwise.bias, ScalingRecipe.ROWWISE))


def test_fp8_eligible_and_options_checks() -> None:
    assert fp8_eligible(16, 32)
    assert not fp8_eligible(16, 24)
    assert not fp8_eligible(8, 16)
    assert not fp8_eligible(32, 32, Fp8Options(min_features=64))
    with pytest.raises(TypeError, match="ScalingRecipe"):
        Fp8Options(recipe="rowwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_features"):
        Fp8Options(min_features=0)
    with pytest.raises(TypeError, match="tuple"):
        Fp8Options(exclude="lm_head")  # type: ignore[arg-type]


def test_fp8_options_excludes_matches_whole_dotted_suffixes() -> None:
    # the one name match of every use_fp8 conversion: the name itself or its last dotted parts, never a substring
    options = Fp8Options(exclude=("lm_head", "mlp.gate"))
    assert options.excludes("lm_head")
    assert options.excludes("model.lm_head")
    assert options.excludes("layers.0.mlp.gate")
    assert not options.excludes("my_lm_head")
    assert not options.excludes("lm_head.inner")
    assert not options.excludes("layers.0.mlp.gate_proj")
    assert not Fp8Options(exclude=()).excludes("lm_head")
