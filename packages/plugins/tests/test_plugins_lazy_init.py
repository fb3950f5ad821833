"""`LazyInitContext`: a model built inside it holds no memory until `boost` (or `materialize`), then has exactly the
values an eager construction after the same seed has, with parameter identity (optimizers built before boost, tied
weights) kept; boosted lazily or eagerly, training is identical."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh.testing import distributed
from cx_plugins import Booster, GeminiPlugin, LazyInitContext, LowLevelZeroPlugin


class _Net(nn.Module):
    """Embedding with a padding row (a view written in place), norms with buffers, a tied head, a plain tensor
    attribute computed from a factory (like a rotary table)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16, padding_idx=0)
        self.first = nn.Linear(16, 24)
        self.body = nn.Sequential(self.first, nn.GELU(), nn.Linear(24, 16), nn.LayerNorm(16))
        self.norm = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight
        self.table = 1.0 / (100.0 ** (torch.arange(0, 8, 2).float() / 8))
        nn.init.normal_(self.first.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.body(self.embed(ids)).mean(dim=1)
        logits: torch.Tensor = self.head(self.norm(hidden) * self.table.sum())
        return logits


def _eager_and_lazy() -> tuple[_Net, _Net]:
    torch.manual_seed(7)
    eager = _Net()
    torch.manual_seed(7)
    with LazyInitContext():
        lazy = _Net()
    return eager, lazy


def test_lazy_model_holds_no_memory_and_materialises_to_eager_values() -> None:
    eager, lazy = _eager_and_lazy()
    assert all(p.device.type == "meta" for p in lazy.parameters())
    assert sum(p.numel() for p in lazy.parameters()) == sum(p.numel() for p in eager.parameters())
    optimizer = torch.optim.SGD(lazy.parameters(), lr=0.1)  # built on the lazy parameters
    before = [id(p) for p in lazy.parameters()]
    LazyInitContext.materialize(lazy)
    assert [id(p) for p in lazy.parameters()] == before
    assert optimizer.param_groups[0]["params"][0] is lazy.embed.weight
    assert lazy.head.weight is lazy.embed.weight  # still tied
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(lazy.table, eager.table, rtol=0, atol=0)
    ids = torch.randint(0, 32, (4, 5))
    torch.testing.assert_close(lazy(ids), eager(ids), rtol=0, atol=0)


def test_lazy_hf_llama_materialises_to_eager_values() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(3)
    eager = transformers.LlamaForCausalLM(config)
    torch.manual_seed(3)
    context = LazyInitContext()
    with context:
        lazy = transformers.LlamaForCausalLM(config)
    LazyInitContext.materialize(lazy)
    # post_init initialises every weight a second time: the first values are dropped early, so the replay never
    # held more than the largest parameter at once
    assert context.stats.peak_bytes <= max(p.numel() * p.element_size() for p in eager.parameters())
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(lazy(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss)


def test_lazy_construction_errors_say_what_cannot_run_lazily() -> None:
    class ReadsValues(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = float(torch.ones(1).sum().item())

    with pytest.raises(RuntimeError) as caught, LazyInitContext():
        ReadsValues()
    assert any("cannot run lazily" in note for note in getattr(caught.value, "__notes__", []))
    with pytest.raises(NotImplementedError, match="tensor_cls"):
        LazyInitContext(tensor_cls=object)
    with pytest.raises(ValueError, match="no LazyInitContext recorded"):
        LazyInitContext.materialize(nn.Linear(2, 2, device="meta"))


@distributed(world_size=2)
@pytest.mark.parametrize("plugin_name", ["low_level_zero", "gemini"])
def test_lazily_built_model_trains_like_the_eager_one(rank: int, world_size: int, plugin_name: str) -> None:
    losses: list[list[float]] = []
    for lazy in (False, True):
        torch.manual_seed(11)
        if lazy:
            with LazyInitContext():
                model: nn.Module = _Net()
        else:
            model = _Net()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)  # before boost, on lazy parameters too
        plugin = (
            LowLevelZeroPlugin(stage=2, precision="fp32")
            if plugin_name == "low_level_zero"
            else GeminiPlugin(precision="fp32")
        )
        booster = Booster(plugin=plugin)
        boosted, boosted_optimizer, *_ = booster.boost(model, optimizer)
        assert boosted_optimizer is not None
        generator = torch.Generator().manual_seed(rank)
        run = []
        for _ in range(3):
            ids = torch.randint(1, 32, (4, 5), generator=generator)
            loss = boosted(ids).float().logsumexp(dim=-1).mean()
            booster.backward(loss, boosted_optimizer)
            boosted_optimizer.step()
            boosted_optimizer.zero_grad()
            run.append(float(loss))
        losses.append(run)
    assert losses[1] == losses[0]
