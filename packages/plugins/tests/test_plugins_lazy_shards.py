"""A model built under `LazyInitContext` is never whole on any rank when Gemini boosts it: the replay hands each
parameter over as soon as construction is done with it and GeminiDDP copies this rank's part into its chunk.
Measured: the bytes of real tensors the replay holds at once (`LazyInitContext.stats`, storage accounting of the
tape) stay at the largest parameter, far below the model; the chunks' own accounting shows one chunk's buffer at
most during construction; and every value equals an eager build's with the same seed (training too). Also: a tape
is released once its model is materialised or dropped, and `is_lazy` looks at the root only."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cx_plugins.lazy._context as lazy_init
from cx_chunk import ChunkManager
from cx_mesh.testing import TEST_ADAM_EPS, distributed, tiny_model_adam_tolerance
from cx_plugins import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LazyInitContext,
    LowLevelZeroPlugin,
    ModelWrapper,
    TorchDDPPlugin,
)
from cx_plugins._layout import Axis
from cx_plugins.gemini._plugin import GeminiModel
from cx_plugins.lazy._context import is_lazy
from cx_shardformer import get_shard_spec, shard_tensor

_CHUNK = 4096  # elements: the model below needs several chunks


class _Stack(nn.Module):
    """Embedding, eight blocks, a norm and a head, then a second initialisation of every linear layer (as
    transformers' `post_init` does), which makes each first initialisation dead before the end of construction."""

    def __init__(self, blocks: int = 8, width: int = 32, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(blocks)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("scale", torch.full((width,), 0.5))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # activation checkpointing: backward re-reads parameters, so it catches a parameter that looks modified
        hidden = checkpoint(self.blocks, self.embed(ids), use_reentrant=False)
        hidden = self.norm(hidden * self.scale)
        logits: torch.Tensor = self.head(hidden)
        return logits


def _sizes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the largest parameter, bytes of all parameters)."""
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return max(sizes), sum(sizes)


@distributed(world_size=2)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gemini_materialises_a_lazy_model_one_parameter_at_a_time(rank: int, world_size: int, precision: str) -> None:
    torch.manual_seed(5)
    eager = _Stack()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = _Stack()
    optimizer = torch.optim.Adam(lazy.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    plugin = GeminiPlugin(precision=precision, chunk_config_dict={"chunk_size": _CHUNK, "keep_gathered": False})
    booster = Booster(plugin=plugin)
    boosted, boosted_optimizer, *_ = booster.boost(lazy, optimizer)
    assert boosted_optimizer is not None
    assert isinstance(boosted, GeminiModel)
    largest, whole = _sizes(eager)
    # the replay never held more than the largest parameter's bytes at once (the model is 10x that)
    assert context.stats.wanted_bytes >= whole
    assert context.stats.peak_bytes <= largest
    assert context.stats.peak_bytes * 8 < whole
    # chunks: built one at a time from the shapes, each full buffer dropped at close; this rank keeps its part
    manager: ChunkManager = boosted.ddp.manager
    chunks = manager.chunks()
    assert len(chunks) >= 3
    assert sum(c.shard_nbytes for c in chunks) * world_size == sum(c.nbytes for c in chunks)
    peak, now = manager.peak, manager.usage
    assert peak.device + peak.host <= now.device + now.host + max(c.nbytes for c in chunks)
    # values: exactly the eager build's (gathered from the shards of both ranks)
    state = boosted.state_dict(only_rank_0=False)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    assert not is_lazy(lazy)
    # and it trains like the eager model in one process (Adam, both ranks' batches together)
    reference = torch.optim.Adam(eager.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    for step in range(2):
        ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step))
        loss = boosted(ids[rank * 2 : rank * 2 + 2]).float().logsumexp(dim=-1).mean()
        booster.backward(loss, boosted_optimizer)
        boosted_optimizer.step()
        boosted_optimizer.zero_grad()
        eager(ids).logsumexp(dim=-1).mean().backward()
        reference.step()
        reference.zero_grad()
    # fp32: Adam at TEST_ADAM_EPS, so the ranks' summation order is all that differs; bf16: a few bf16 roundings
    tolerance = tiny_model_adam_tolerance(1e-2, steps=2, tokens=ids.numel()) if precision == "fp32" else 2e-2
    state = boosted.state_dict(only_rank_0=False)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=tolerance, atol=tolerance, msg=name)


def test_materialising_in_place_holds_the_model_plus_one_parameter() -> None:
    # plugins whose ranks hold every parameter in full (DDP, LowLevelZero, ShardFormer before slicing) get the model
    # materialised in place: each parameter becomes the replay's own tensor (no second copy of the model)
    torch.manual_seed(5)
    eager = _Stack()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = _Stack()
    LazyInitContext.materialize(lazy)
    largest = _sizes(eager)[0]
    assert context.stats.peak_bytes <= largest
    assert all(p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in lazy.parameters())
    for (name, a), (_, b) in zip(eager.state_dict().items(), lazy.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_a_tape_is_released_once_its_model_is_materialised_or_dropped() -> None:
    with LazyInitContext():
        model = _Stack()
    tape = weakref.ref(lazy_init._TAPE_OF[model])
    LazyInitContext.materialize(model)
    gc.collect()
    assert tape() is None
    assert not any(module in lazy_init._TAPE_OF for module in model.modules())
    with LazyInitContext():
        dropped = _Stack()
    tape = weakref.ref(lazy_init._TAPE_OF[dropped])
    del dropped
    gc.collect()
    assert tape() is None


def test_is_lazy_looks_at_the_root_only(monkeypatch: pytest.MonkeyPatch) -> None:
    with LazyInitContext():
        model = _Stack()
    eager = _Stack()

    def scan(*args: object) -> None:
        raise AssertionError("is_lazy scanned the model")

    monkeypatch.setattr(lazy_init, "_lazy_tensors", scan)
    monkeypatch.setattr(nn.Module, "modules", scan)
    assert is_lazy(model)
    assert not is_lazy(eager)
    assert is_lazy(nn.Sequential(model))  # wrapped outside the context: recognised by its first tensor
    monkeypatch.undo()
    LazyInitContext.materialize(model)
    assert not is_lazy(model)


@distributed(world_size=2)
@pytest.mark.parametrize("plugin_name", ["ddp", "low_level_zero"])
def test_plugins_holding_full_parameters_get_the_lazy_model_materialised(
    rank: int, world_size: int, plugin_name: str
) -> None:
    torch.manual_seed(5)
    eager = _Stack()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = _Stack()
    plugin = TorchDDPPlugin() if plugin_name == "ddp" else LowLevelZeroPlugin(stage=2, precision="fp32")
    optimizer = torch.optim.SGD(lazy.parameters(), lr=0.1)
    boosted, *_ = Booster(plugin=plugin).boost(lazy, optimizer)
    assert context.stats.peak_bytes <= _sizes(eager)[0]
    assert isinstance(boosted, ModelWrapper)
    state = boosted.unwrap().state_dict()
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)


@distributed(world_size=2)
@pytest.mark.parametrize("sync_module_states", [False, True])
def test_fsdp_cuts_each_lazy_parameter_into_its_shard(rank: int, world_size: int, sync_module_states: bool) -> None:
    """TorchFSDPPlugin shards the meta model and fills each rank's FSDP2 shard from the replay, one parameter at a
    time: the shards hold the eager values exactly and training matches one process."""
    from torch.distributed.tensor import DTensor

    from cx_plugins import TorchFSDPPlugin

    torch.manual_seed(5)
    eager = _Stack()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = _Stack()
    optimizer = torch.optim.Adam(lazy.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    originals = list(lazy.parameters())
    booster = Booster(plugin=TorchFSDPPlugin(sync_module_states=sync_module_states))
    boosted, boosted_optimizer, *_ = booster.boost(lazy, optimizer)
    assert boosted_optimizer is not None
    # the full-size parameters were never made: FSDP replaced them while still on the meta device
    assert all(p.is_meta for p in originals)
    assert context.stats.peak_bytes <= _sizes(eager)[0]
    assert not is_lazy(lazy)
    assert isinstance(boosted, ModelWrapper)
    module = boosted.unwrap()
    held = sum(p.to_local().numel() for p in module.parameters() if isinstance(p, DTensor))
    assert held < sum(p.numel() for p in eager.parameters())  # this rank holds its shards only
    reference = torch.optim.Adam(eager.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    for step in range(3):
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in module.state_dict().items()}
        for name, value in eager.state_dict().items():
            tolerance = 0.0 if step == 0 else tiny_model_adam_tolerance(1e-2, steps=step, tokens=4 * 6)
            torch.testing.assert_close(full[name], value, rtol=tolerance, atol=tolerance, msg=f"step {step} {name}")
        ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(step))
        loss = boosted(ids[rank * 2 : rank * 2 + 2]).logsumexp(dim=-1).mean()
        booster.backward(loss, boosted_optimizer)
        boosted_optimizer.step()
        boosted_optimizer.zero_grad()
        eager(ids).logsumexp(dim=-1).mean().backward()
        reference.step()
        reference.zero_grad()


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_hidden_layers=2, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model: nn.Module = transformers.GPT2LMHeadModel(config)  # tied embeddings, fused qkv in Conv1D
    return model


@distributed(world_size=2)
@pytest.mark.parametrize(("plugin_name", "model_name"), [("hybrid", "llama"), ("hybrid", "gpt2"), ("gemini", "llama")])
def test_tensor_parallel_plugins_cut_each_lazy_parameter_to_its_slice(
    rank: int, world_size: int, plugin_name: str, model_name: str
) -> None:
    build = _llama if model_name == "llama" else _gpt2
    torch.manual_seed(5)
    eager = build()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = build()
    plugin: HybridParallelPlugin | GeminiPlugin = (
        HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", enable_all_optimization=model_name == "gpt2")
        if plugin_name == "hybrid"
        else GeminiPlugin(tp_size=2, precision="fp32")
    )
    optimizer = torch.optim.SGD(lazy.parameters(), lr=0.1)
    boosted, *_ = Booster(plugin=plugin).boost(lazy, optimizer)
    # ShardFormer sharded the meta model; each full value existed only until it was cut to this rank's slice
    assert context.stats.peak_bytes <= _sizes(eager)[0]
    split = [name for name, p in lazy.named_parameters() if get_shard_spec(p) is not None]
    assert split
    # this rank holds exactly the eager values' slices: in place (hybrid), in its chunks (gemini, gathered here)
    local = dict(lazy.named_parameters())
    held = (
        boosted.state_dict(only_rank_0=False)
        if isinstance(boosted, GeminiModel)
        else {name: p.detach() for name, p in local.items()}
    )
    for name, value in eager.named_parameters():
        spec = get_shard_spec(local[name])
        group = plugin.layout.group(Axis.TP)
        expected = value.detach() if spec is None else shard_tensor(value.detach(), spec, group)
        torch.testing.assert_close(held[name], expected, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        boosted.eval()
        eager.eval()
        loss = boosted(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


def _mixtral() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32, use_cache=False,
        output_router_logits=True, tie_word_embeddings=False,
    )  # fmt: skip
    model: nn.Module = transformers.MixtralForCausalLM(config)
    return model


@distributed(world_size=2)
@pytest.mark.parametrize("tp", [1, 2])
def test_expert_parallel_plugin_cuts_each_lazy_expert_stack_to_its_experts(rank: int, world_size: int, tp: int) -> None:
    """MoeHybridParallelPlugin: cx-moe narrows each meta expert stack in place to this rank's experts (and TP its
    other layers), then each full stack from the replay is cut to those experts before the next one is made."""
    from cx_moe import get_moe_info
    from cx_plugins import MoeHybridParallelPlugin

    torch.manual_seed(5)
    eager = _mixtral()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = _mixtral()
    ep = world_size // tp
    plugin = MoeHybridParallelPlugin(tp_size=tp, pp_size=1, ep_size=ep, precision="fp32")
    optimizer = torch.optim.SGD(lazy.parameters(), lr=0.1)
    originals = dict(lazy.named_parameters())
    boosted, *_ = Booster(plugin=plugin).boost(lazy, optimizer)
    assert context.stats.peak_bytes <= _sizes(eager)[0]
    local = dict(lazy.named_parameters())
    # the parameters the user built are the ones that train, and none ever held more than this rank's part
    assert all(local[name] is param for name, param in originals.items())
    experts = [name for name, p in local.items() if get_moe_info(p) is not None]
    assert len(experts) == 4 if ep > 1 else not experts  # gate_up_proj and down_proj of both layers
    for name, value in eager.named_parameters():
        expected = value.detach()
        info = get_moe_info(local[name])
        if info is not None:
            share = info.num_experts // info.ep_size
            expected = expected[info.ep_rank * share : (info.ep_rank + 1) * share]
        spec = get_shard_spec(local[name])
        if spec is not None:
            expected = shard_tensor(expected, spec, plugin.layout.group(Axis.TP))
        torch.testing.assert_close(local[name].detach(), expected, rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        boosted.eval()
        eager.eval()
        loss = boosted(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, eager(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


@distributed(world_size=2)
def test_pipeline_stages_materialise_only_their_own_parameters(rank: int, world_size: int) -> None:
    torch.manual_seed(5)
    eager = _llama()
    torch.manual_seed(5)
    context = LazyInitContext()
    with context:
        lazy = _llama()
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", num_microbatches=2)
    Booster(plugin=plugin).boost(lazy, torch.optim.SGD(lazy.parameters(), lr=0.1))
    assert context.stats.peak_bytes <= _sizes(eager)[0]
    local = dict(lazy.named_parameters())
    made = [name for name, p in local.items() if not p.is_meta]
    assert made
    assert len(made) < len(local)  # the other stage's parameters were never materialised here
    for name in made:
        torch.testing.assert_close(local[name].detach(), eager.get_parameter(name).detach(), rtol=0, atol=0, msg=name)
