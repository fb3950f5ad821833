"""Bad input to GeminiDDP / GeminiOptimizer: clear errors naming the problem and what is accepted."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import make_gpt

BAD_ARGUMENTS = [
    ({"placement_policy": "foo"}, ValueError, r"placement_policy='foo' is not supported; accepted: 'static', 'auto'"),
    ({"shard_param_frac": 1.5}, ValueError, r"shard_param_frac must be in \[0, 1\], got 1.5"),
    ({"offload_optim_frac": -0.1}, ValueError, r"offload_optim_frac must be in \[0, 1\]"),
    ({"mixed_precision": torch.float64}, ValueError, r"torch.float64 is not supported; accepted: torch.float32"),
    ({"max_prefetch": -1}, ValueError, r"max_prefetch must be >= 0"),
    ({"chunk_config_dict": {"size": 10}}, ValueError, r"must have 'chunk_size'"),
    ({"strict_ddp_mode": True, "placement_policy": "auto"}, ValueError, r"strict_ddp_mode=True .* needs"),
    ({"chunk_config_dict": {"chunk_size": 64}, "hidden_dim": 8}, ValueError, r"do not apply when chunk_config_dict"),
]


@distributed(world_size=1)
@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_ARGUMENTS)
def test_zero_gemini_errors_bad_arguments(
    rank: int, world_size: int, kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        GeminiDDP(make_gpt(), **kwargs)  # type: ignore[arg-type]


IGNORED_AS_IN_COLOSSALAI = [
    ({"offload_param_frac": 0.5}, "offload_param_frac=0.5 (needs shard_param_frac=1.0 and offload_optim_frac=1.0)"),
    ({"placement_policy": "auto", "offload_optim_frac": 1.0}, "offload_optim_frac=1.0"),
    ({"steady_cuda_cap_ratio": 0.5}, "steady_cuda_cap_ratio=0.5"),
    ({"warmup_non_model_data_ratio": 0.1, "steady_cuda_cap_ratio": 0.7}, "warmup_non_model_data_ratio=0.1, steady"),
]


@distributed(world_size=1)
@pytest.mark.parametrize(("kwargs", "named"), IGNORED_AS_IN_COLOSSALAI)
def test_zero_gemini_ignored_combinations_warn_once_naming_them(
    rank: int, world_size: int, kwargs: dict[str, object], named: str
) -> None:
    # ColossalAI accepts these and ignores the values its placement policy does not read: so does cx, saying so
    with pytest.warns(UserWarning, match="ignores") as caught:
        ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32, **kwargs)  # type: ignore[arg-type]
    messages = [str(w.message) for w in caught if "ignores" in str(w.message)]
    assert len(messages) == 1
    assert named in messages[0]
    defaults = {"offload_param_frac": 0.0, "offload_optim_frac": 0.0, "steady_cuda_cap_ratio": 0.9}
    for name, value in defaults.items():
        assert getattr(ddp.options, name) == value


@distributed(world_size=1)
def test_zero_gemini_colossalai_only_arguments_are_accepted(rank: int, world_size: int) -> None:
    with pytest.warns(UserWarning, match="scatter_after_inference=False"):
        ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32, scatter_after_inference=False)
    with pytest.warns(UserWarning, match=r"GeminiOptimizer ignores \['lr'\]"):
        GeminiOptimizer(torch.optim.AdamW(ddp.parameters()), ddp, lr=1e-3)
    # fp8 communication rounds gathered values to fp8: only where a master keeps the exact weights
    with pytest.raises(ValueError, match=r"fp8_communication=True needs fp32 master weights"):
        GeminiDDP(make_gpt(), mixed_precision=torch.float32, fp8_communication=True)
    with pytest.raises(ValueError, match=r"fp8_communication=True needs fp32 master weights"):
        GeminiDDP(make_gpt(), mixed_precision=torch.bfloat16, master_weights=False, fp8_communication=True)


@distributed(world_size=1)
def test_zero_gemini_errors_bad_modules(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="no parameters"):
        GeminiDDP(nn.ReLU())
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        GeminiDDP(frozen)
    with pytest.raises(NotImplementedError, match=r"sparse gradients are not supported.*\['0'\]"):
        GeminiDDP(nn.Sequential(nn.Embedding(4, 2, sparse=True)))
    model = make_gpt()
    GeminiDDP(model, mixed_precision=torch.float32)
    with pytest.raises(ValueError, match="already wrapped"):
        GeminiDDP(model)


@distributed(world_size=2)
def test_zero_gemini_errors_module_called_outside_wrapper(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(make_gpt(), chunk_config_dict={"chunk_size": 2048}, mixed_precision=torch.float32)
    with pytest.raises(RuntimeError, match=r"called outside GeminiDDP.forward"):
        ddp.module(torch.zeros(1, 4, dtype=torch.long))
    # the wrapper still works afterwards
    with torch.no_grad():
        assert ddp(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 64)


@distributed(world_size=1)
def test_zero_gemini_errors_unsupported_state_dict_arguments(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32)
    with pytest.raises(NotImplementedError, match="keep_vars"):
        ddp.state_dict(keep_vars=True)
    state = ddp.state_dict()
    with pytest.raises(RuntimeError, match=r"missing keys \['ln_f.weight'\]"):
        ddp.load_state_dict({k: v for k, v in state.items() if k != "ln_f.weight"})
    with pytest.raises(ValueError, match=r"'ln_f.weight' has shape \[3\]"):
        ddp.load_state_dict({**state, "ln_f.weight": torch.zeros(3)})


class _ReadsGrandchild(nn.Module):
    """Reads a grandchild's weight directly: outside the documented unit rule."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Sequential(nn.Linear(4, 4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = cast(nn.Linear, self.inner.get_submodule("0.0"))
        out: torch.Tensor = x @ linear.weight.t()
        return out


@distributed(world_size=2)
def test_zero_gemini_errors_parameter_read_outside_its_unit(rank: int, world_size: int) -> None:
    ddp = GeminiDDP(_ReadsGrandchild(), chunk_config_dict={"chunk_size": 32}, mixed_precision=torch.float32)
    with pytest.raises(RuntimeError) as info:
        ddp(torch.ones(2, 4))
    assert "call the module that owns the parameter" in "".join(getattr(info.value, "__notes__", []))
    ddp.eval()  # still usable for well-formed calls afterwards: the chunks were released
    assert not any(c.is_gathered for c in ddp.manager.chunks())


@distributed(world_size=1)
def test_zero_gemini_errors_refused_optimizer_is_left_unchanged(rank: int, world_size: int) -> None:
    """A tensor that is not one of the model's parameters is refused before the optimizer is touched: its param
    groups still hold the model's parameters, so it can be fixed and wrapped."""
    ddp = GeminiDDP(make_gpt(), mixed_precision=torch.float32)
    params = list(ddp.parameters())
    stranger = nn.Parameter(torch.zeros(3))
    inner = torch.optim.SGD([{"params": params}, {"params": [stranger]}], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the GeminiDDP module"):
        GeminiOptimizer(inner, ddp)
    assert inner.param_groups[0]["params"] == params
    assert "param_names" not in inner.param_groups[0]
    inner.param_groups.pop()
    assert len(GeminiOptimizer(inner, ddp).param_groups[0]["params"]) == len(params)
