"""MuonWithAdamW on one process: bit-identical to torch.optim.Muon on its Muon groups plus torch.optim.AdamW on the
others (the same torch functions do the math), `muon_param_groups` sorts by Muon's recipe, its state dict resumes
bit-exactly, it is whole-tensor for the ZeRO engines, and bad groups are refused by name."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch import nn

from cx_zero import MuonWithAdamW, is_elementwise, muon_param_groups, needs_whole_tensors

STEPS = 4


class _Tiny(nn.Module):
    """Embedding, two hidden matrices with biases, a norm and a head tied (or not) to the embedding."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        hidden = hidden + self.down(torch.tanh(self.up(hidden)))
        return torch.as_tensor(self.lm_head(self.norm(hidden)))


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 11, (4, 5), generator=generator)
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    groups = muon_param_groups(model)
    groups[0]["lr"] = 0.02  # a group-level option overrides the default
    return groups


def _ours(model: nn.Module) -> MuonWithAdamW:
    return MuonWithAdamW(_groups(model), lr=0.01, weight_decay=0.05, adamw_lr=3e-3, adamw_weight_decay=0.02)


@pytest.mark.parametrize("tied", [False, True])
def test_muon_param_groups_follow_the_recipe(tied: bool) -> None:
    model = _Tiny(tied)
    muon, adamw = muon_param_groups(model)
    assert muon["use_muon"]
    assert not adamw["use_muon"]
    assert [id(p) for p in muon["params"]] == [id(model.up.weight), id(model.down.weight)]
    want = {id(model.embed.weight), id(model.up.bias), id(model.down.bias), id(model.norm.weight)}
    want |= {id(model.norm.bias), id(model.lm_head.weight)}
    assert {id(p) for p in adamw["params"]} == want
    assert len(adamw["params"]) == len(want)  # a tied head is one parameter


@pytest.mark.parametrize("tied", [False, True])
def test_muon_with_adamw_equals_torch_muon_plus_adamw(tied: bool) -> None:
    model, reference = _Tiny(tied), _Tiny(tied)
    ours = _ours(model)
    muon_group, adamw_group = muon_param_groups(reference)
    torch_muon = torch.optim.Muon(muon_group["params"], lr=0.02, weight_decay=0.05)
    torch_adamw = torch.optim.AdamW(adamw_group["params"], lr=3e-3, weight_decay=0.02)
    for step in range(STEPS):
        _loss(model, step).backward()
        ours.step()
        ours.zero_grad()
        _loss(reference, step).backward()
        torch_muon.step()
        torch_adamw.step()
        torch_muon.zero_grad()
        torch_adamw.zero_grad()
    for (name, mine), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine, want), name
    assert all(set(ours.state[p]) == {"momentum_buffer"} for p in ours.param_groups[0]["params"])
    assert all(set(ours.state[p]) == {"step", "exp_avg", "exp_avg_sq"} for p in ours.param_groups[1]["params"])


def test_muon_with_adamw_state_dict_resumes_exactly() -> None:
    model = _Tiny(tied=False)
    optimizer = _ours(model)
    for step in range(2):
        _loss(model, step).backward()
        optimizer.step()
        optimizer.zero_grad()
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # tensors and plain values only: no pickled code
    resumed = _Tiny(tied=False)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = _ours(resumed)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    for step in range(2, 4):
        for each, each_optimizer in ((model, optimizer), (resumed, resumed_optimizer)):
            _loss(each, step).backward()
            each_optimizer.step()
            each_optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_muon_with_adamw_is_whole_tensor() -> None:
    optimizer = _ours(_Tiny(tied=False))
    assert needs_whole_tensors(optimizer)
    assert not is_elementwise(optimizer)


def test_muon_with_adamw_refuses_bad_groups() -> None:
    model = _Tiny(tied=False)
    with pytest.raises(TypeError, match="muon_param_groups"):
        MuonWithAdamW(model.parameters())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="use_muon"):
        MuonWithAdamW([{"params": [model.up.weight]}])
    with pytest.raises(ValueError, match="2-D matrices only \\(or 3-D stacks"):
        MuonWithAdamW([{"params": [model.up.bias], "use_muon": True}])
    with pytest.raises(ValueError, match="unknown option"):
        MuonWithAdamW([{"params": [model.up.bias], "use_muon": False, "momentum": 0.9}])


class _Experts(nn.Module):
    """Fused experts as transformers 5 holds them: one (experts, out, in) stack per projection."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(3, 10, 6) * 0.3)
        self.down = nn.Parameter(torch.randn(3, 6, 10) * 0.3)
        self.up_bias = nn.Parameter(torch.zeros(3, 10))  # per-expert biases (gpt-oss): 2-D, not a matrix: AdamW


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = _Experts()
        self.pos = nn.Parameter(torch.randn(1, 5, 6) * 0.1)  # 3-D, but not an expert stack: AdamW

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.one_hot(tokens, 6).float() + self.pos
        out = hidden
        for expert in range(3):  # every token through every expert (no router: the stack math is what is tested)
            up = torch.tanh(hidden @ self.experts.up[expert].T + self.experts.up_bias[expert])
            out = out + (expert + 1) * (up @ self.experts.down[expert].T)
        return out


def _moe_loss(model: nn.Module, step: int) -> torch.Tensor:
    tokens = torch.randint(0, 6, (4, 5), generator=torch.Generator().manual_seed(step))
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_with_adamw_steps_each_expert_of_a_stack_as_torch_muon(nesterov: bool) -> None:
    """A 3-D expert stack in a Muon group: each expert's matrix stepped bit-identically to torch's Muon on that
    matrix as its own 2-D parameter (the learning rate adjusted from one expert's shape); a 3-D parameter outside
    `experts` and the experts' 2-D bias stack follow AdamW."""
    model = _Moe()
    muon, adamw = muon_param_groups(model)
    assert [id(p) for p in muon["params"]] == [id(model.experts.up), id(model.experts.down)]
    assert {id(p) for p in adamw["params"]} == {id(model.experts.up_bias), id(model.pos)}
    ours = MuonWithAdamW([muon, adamw], lr=0.02, weight_decay=0.05, nesterov=nesterov, adjust_lr_fn="original")
    matrices = [nn.Parameter(stack.detach()[e].clone()) for stack in (model.experts.up, model.experts.down)
                for e in range(3)]  # fmt: skip
    torch_muon = torch.optim.Muon(matrices, lr=0.02, weight_decay=0.05, nesterov=nesterov, adjust_lr_fn="original")
    for step in range(STEPS):
        _moe_loss(model, step).backward()
        up, down = model.experts.up.grad, model.experts.down.grad
        assert up is not None
        assert down is not None
        for matrix, grad in zip(matrices, [*up.unbind(0), *down.unbind(0)], strict=True):
            matrix.grad = grad.clone()
        ours.step()
        ours.zero_grad()
        torch_muon.step()
        torch_muon.zero_grad()
    mine = [*model.experts.up.unbind(0), *model.experts.down.unbind(0)]
    for index, (got, want) in enumerate(zip(mine, matrices, strict=True)):
        assert torch.equal(got, want), index
    assert not torch.equal(model.experts.up[0], model.experts.up[1])  # the experts really differ
