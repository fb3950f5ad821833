"""The ranks of one model replica agree (issue 22, items 7 and 8).

Weights: tp (and pp) ranks that built the model with different values (another seed, a perturbed tensor, a lazily
built model under another seed) all train global rank 0's model after boost, matching one process that trains rank
0's model; a tied weight whose copies differ between pipeline stages is made one again. Batches: tp ranks given
different batches (first calls, and a call whose shapes changed) raise `RankMismatchError` naming the group, the
ranks and the inputs; pipeline stages given different labels too; equal batches pass. At ep 2 the expert slices
and dense weights are rank 0's too.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh import RankMismatchError
from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin, LazyInitContext, MoeHybridParallelPlugin

STEPS = 3


def _llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_hidden_layers=2, use_cache=False, attention_dropout=0.0,
    )  # fmt: skip


def _train_like_reference(plugin: HybridParallelPlugin, model: nn.Module, reference: nn.Module) -> None:
    """Train the boosted `model` and one process's `reference` on the same batches; losses and parameters agree."""
    from hybrid_test_helpers import LR, batch, compare_parameters

    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        data = batch(step)
        if plugin.pp_size > 1:
            loss = booster.execute_pipeline(iter([data]), boosted, lambda out, _: out.loss, optimizer)["loss"]
        else:
            loss = boosted(**data).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        expected = reference(**data).loss
        expected.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if loss is not None:  # fp32 throughout: the tp split only reorders sums (as in test_plugins_hybrid)
            torch.testing.assert_close(float(loss), float(expected), rtol=1e-4, atol=1e-5)
    compare_parameters(boosted, reference, plugin, rtol=1e-4, atol=1e-5)


@distributed(world_size=2)
def test_plugins_hybrid_tp_ranks_start_from_rank0_model(rank: int, world_size: int) -> None:
    """Rank 1 builds its model with another seed and perturbs a weight and a buffer: after boost both ranks train
    rank 0's model."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(_llama_config())
    torch.manual_seed(rank)
    model = transformers.LlamaForCausalLM(_llama_config())
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(1.0)
            model.model.rotary_emb.inv_freq.mul_(2.0)
    _train_like_reference(HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"), model, reference)


@distributed(world_size=2)
def test_plugins_hybrid_lazy_tp_ranks_replay_rank0_seed(rank: int, world_size: int) -> None:
    """A lazily built model under per-rank seeds materialises rank 0's values on every tp rank."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(_llama_config())
    torch.manual_seed(rank)
    with LazyInitContext():
        lazy = transformers.LlamaForCausalLM(_llama_config())
    _train_like_reference(HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"), lazy, reference)


@distributed(world_size=2)
def test_plugins_hybrid_pp_tied_copies_agree(rank: int, world_size: int) -> None:
    """GPT-2 ties wte to the LM head, held by stage 0 and stage 1: a rank 1 built under another seed trains rank 0's
    model, tied copies equal."""
    pytest.importorskip("transformers")
    from hybrid_test_helpers import gpt2

    reference = gpt2(layers=2)
    model = copy.deepcopy(reference)
    if rank == 1:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param))
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32")
    _train_like_reference(plugin, model, reference)


@distributed(world_size=2)
def test_plugins_hybrid_tp_ranks_given_different_batches(rank: int, world_size: int) -> None:
    pytest.importorskip("transformers")
    from hybrid_test_helpers import batch, llama

    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"))
    model, *_ = booster.boost(llama(layers=2))
    with pytest.raises(RankMismatchError) as caught:
        model(**batch(rank))
    message = str(caught.value)
    assert "over the tp group (global ranks [0, 1]) ranks [1] were given a different one than ranks [0]" in message
    assert "the values of input_ids, labels differ" in message
    with torch.no_grad():
        for step in range(5):  # equal batches pass; past the first calls only a change of shape looks again
            model(**batch(step))
        changed = {k: v[:, :4] for k, v in batch(10 + rank).items()}
        with pytest.raises(RankMismatchError, match=r"the values of input_ids, labels differ"):
            model(**changed)
        shapes = {"input_ids": batch(0)["input_ids"][: 2 + 2 * rank]}
        with pytest.raises(RankMismatchError, match=r"names, shapes or dtypes differ .*input_ids: \(\d, 8\)"):
            model(**shapes)


@distributed(world_size=2)
def test_plugins_hybrid_pp_stages_given_different_labels(rank: int, world_size: int) -> None:
    pytest.importorskip("transformers")
    from hybrid_test_helpers import batch, llama

    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32")
    booster = Booster(plugin=plugin)
    net = llama(layers=2)
    model, optimizer, *_ = booster.boost(net, torch.optim.SGD(net.parameters(), lr=0.1))
    booster.execute_pipeline(iter([batch(0)]), model, lambda out, _: out.loss, optimizer)
    data = batch(0)
    data["labels"] = data["labels"] + rank
    with pytest.raises(RankMismatchError, match=r"over the pp group .* the values of labels differ"):
        booster.execute_pipeline(iter([data]), model, lambda out, _: out.loss, optimizer)


@distributed(world_size=2)
def test_plugins_moe_hybrid_ep_ranks_start_from_rank0_model(rank: int, world_size: int) -> None:
    """At ep 2 each rank cuts its experts out of the full stacks it built: a rank 1 built differently still ends up
    with rank 0's experts and dense weights, bit for bit (broadcast copies, so tolerance 0)."""
    pytest.importorskip("transformers")
    from moe_hybrid_test_helpers import compare_parameters, mixtral

    reference = mixtral()
    model = copy.deepcopy(reference)
    if rank == 1:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param))
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32")
    boosted, *_ = Booster(plugin=plugin).boost(model)
    assert isinstance(boosted, HybridParallelModule)
    compare_parameters(boosted, reference, plugin, tol=0.0)
