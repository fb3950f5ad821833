"""Packed documents on every plugin and parallel layout: a batch of two 32-token windows holding 3 and 4 documents,
given as `model(input_ids, labels, position_ids)` with positions restarting at each document and -100 on each
document's first label (packed_test_helpers.py), trains exactly as the documents one at a time on one process (fp32,
HF Llama; Mixtral under expert parallelism; GPT-2 under pp 2 and ring_attn). Checked: the loss (against transformers
run document by document) and every parameter after one SGD step (against one process's step on the per-document
loss), under one process, hybrid tp 2, pp 2 (1F1B, interleaved, zero bubble V), sp split_gather / ring (tp group),
all_to_all / ring_attn (sp 2), pp 2 x ring_attn (4 ranks), MoeHybrid ep 2 (and ep 2 x sp 2 ring_attn on 4 ranks), and
the data-parallel TorchDDP, TorchFSDP, LowLevelZero 2 and Gemini. cx's reference GPT (cx-train's demo model) likewise
on one process, tp 2 and pp 2 (1F1B, interleaved, zero bubble V); it has no sequence parallelism, which it refuses.

The compared loss is the token mean over the batch's counted targets. Where one forward sees the whole batch (one
process, tp 2, every sp mode: the sequence is gathered back before the head) the model's own loss already is that.
The pipeline returns the mean over micro-batches of the criterion, so the criterion weights each micro-batch's token
mean by its share of the counted targets. Data-parallel plugins (and ep 2, data parallel over its 2 ranks) give each
rank one window: its loss is that window's token mean, the gradient the mean of the two ranks' (the reference trains
on that mean of means).
"""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import hybrid_test_helpers
import moe_hybrid_test_helpers
from cx_mesh.testing import distributed
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin, MoeHybridParallelPlugin, TorchFSDPPlugin
from cx_plugins._flash_packing import refuse_flash_packing_hook
from cx_plugins._no_cache import forward_without_cache
from cx_plugins.models import document_mask
from cx_shardformer import KeySpans
from packed_test_helpers import (
    LOSS_TOL,
    PARAM_TOL,
    counted,
    documents,
    gpt,
    gpt_per_document_loss,
    llama,
    mixtral,
    packed_batch,
    per_document_loss,
)
from plugins_test_helpers import full_state, make_plugin

pytest.importorskip("transformers")

LR = 0.1


def test_packed_batch_one_process_matches_documents() -> None:
    """The reference itself: transformers builds the block-diagonal causal mask from restarting position_ids (sdpa
    and eager) when it builds no cache; without position_ids the documents leak into each other (so the check can
    fail), and so they do when the config's use_cache=True makes transformers build a cache (which boost turns off)."""
    docs = documents()
    batch = packed_batch(docs)
    model: Any = llama()
    with torch.no_grad():
        expected = float(per_document_loss(model, docs))
        for implementation in ("sdpa", "eager"):
            model.set_attn_implementation(implementation)
            loss = float(model(**batch, use_cache=False).loss)
            assert abs(loss - expected) < LOSS_TOL, (implementation, loss, expected)
        leaked = float(model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False).loss)
        assert abs(leaked - expected) > 50 * LOSS_TOL
        cached = float(model(**batch).loss)  # the config's use_cache=True: a cache, so no packing detection
        assert abs(cached - expected) > 50 * LOSS_TOL


def test_boost_turns_the_cache_off_for_loss_forwards() -> None:
    """`forward_without_cache`: training forwards and forwards with labels pass use_cache=False unless the caller
    chose; a plain eval forward (as generation's) keeps the config's cache."""
    docs = documents()
    batch = packed_batch(docs)
    model: Any = llama()
    with torch.no_grad():
        expected = float(per_document_loss(model, docs))
    forward_without_cache(model)
    model.train()
    assert abs(float(model(**batch).loss.detach()) - expected) < LOSS_TOL
    model.eval()
    with torch.no_grad():
        assert abs(float(model(**batch).loss) - expected) < LOSS_TOL
        assert model(input_ids=batch["input_ids"]).past_key_values is not None
        assert model(**batch, use_cache=True).past_key_values is not None


def test_flash_attention_refuses_packed_rows() -> None:
    """Flash attention with several packed rows and no mask would attend across documents: refused by name. One row,
    a padding mask, or positions that do not restart pass (transformers handles those)."""
    model: Any = llama()
    model.config._attn_implementation = "flash_attention_2"
    batch = packed_batch(documents())
    with pytest.raises(ValueError, match=r"flash_attention_2.*packed documents.*2 rows"):
        refuse_flash_packing_hook(model, (), dict(batch))
    refuse_flash_packing_hook(model, (), {**batch, "position_ids": batch["position_ids"][:1]})
    refuse_flash_packing_hook(model, (), {**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    refuse_flash_packing_hook(model, (), {**batch, "position_ids": torch.arange(32).expand(2, 32)})
    model.config._attn_implementation = "sdpa"
    refuse_flash_packing_hook(model, (), dict(batch))


def _reference_step(reference: nn.Module, loss: torch.Tensor) -> None:
    loss.backward()
    torch.optim.SGD(reference.parameters(), lr=LR).step()


def _boost(plugin: HybridParallelPlugin, model: nn.Module) -> tuple[Booster, HybridParallelModule, Any]:
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    return booster, boosted, optimizer


def _pipeline_loss(total: int, microbatches: int) -> Any:
    """Criterion whose mean over micro-batches is the token mean over all `total` counted targets."""

    def criterion(outputs: Any, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mine = int((micro_batch["labels"][:, 1:] != -100).sum())
        loss: torch.Tensor = outputs.loss * (mine * microbatches / total)
        return loss

    return criterion


def _record_masks(boosted: HybridParallelModule) -> list[Any]:
    """The attention mask each attention module this rank holds is called with."""
    masks: list[Any] = []

    def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        masks.append(kwargs.get("attention_mask"))

    for name, module in boosted.unwrap().named_modules():
        if name.endswith(("self_attn", ".attn")):  # Llama-style, GPT-2
            module.register_forward_pre_hook(record, with_kwargs=True)
    return masks


LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "num_microbatches": 2},
    "pp2_interleaved": {"pp_size": 2, "num_microbatches": 2, "pp_style": "interleaved", "num_model_chunks": 2},
    "pp2_zbv": {"pp_size": 2, "num_microbatches": 2, "pp_style": "zbv", "num_model_chunks": 2},
    "split_gather": {"tp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"},
    "ring": {"tp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring"},
    "all_to_all": {"sp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "all_to_all"},
    "ring_attn": {"sp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring_attn"},
    # GPT-2: learned positions read the restarting position_ids; under pp its own stage module (GPT2Splitter)
    "pp2_gpt2": {"pp_size": 2, "num_microbatches": 2},
    "ring_attn_gpt2": {"sp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring_attn"},
}


@distributed(world_size=2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_plugins_packed_documents(rank: int, world_size: int, layout: str) -> None:
    _hybrid_matches_documents(
        layout, HybridParallelPlugin(precision="fp32", **{"tp_size": 1, "pp_size": 1, **LAYOUTS[layout]})
    )


@distributed(world_size=4)
def test_plugins_packed_documents_pp2_ring_attn(rank: int, world_size: int) -> None:
    """pp 2 x sp 2 ring_attn: the later stage rebuilds the full-length key spans from the position_ids every stage
    receives with the micro-batch, and takes its sequence shard of the hidden states."""
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, num_microbatches=2, sp_size=2, precision="fp32", enable_sequence_parallelism=True,
        sequence_parallelism_mode="ring_attn",
    )  # fmt: skip
    _hybrid_matches_documents("ring_attn", plugin)


def _hybrid_matches_documents(layout: str, plugin: HybridParallelPlugin) -> None:
    assert plugin.dp_size == 1  # every rank (tp, sp or pp) sees the whole batch
    docs = documents()
    batch = packed_batch(docs)
    model = hybrid_test_helpers.gpt2() if layout.endswith("gpt2") else llama(layers=4)  # 2 x 2 chunks: zbv
    reference = copy.deepcopy(model)
    booster, boosted, optimizer = _boost(plugin, model)
    masks = _record_masks(boosted)
    if plugin.pp_size > 1:
        criterion = _pipeline_loss(counted(docs), 2)
        result = booster.execute_pipeline(iter([batch]), boosted, criterion, optimizer, return_loss=True)
        loss = result["loss"]
    else:
        loss = boosted(**batch).loss
        booster.backward(loss, optimizer)
    optimizer.step()
    expected = per_document_loss(reference, docs)
    if loss is not None:  # pp: the last stage holds it
        assert abs(float(loss) - float(expected)) < LOSS_TOL, (layout, float(loss), float(expected))
    # ring attention keeps the documents as key spans ([B, S] each); the other layouts run transformers' sdpa path
    # with its dense block-diagonal boolean mask
    assert masks, "the attention modules ran"
    assert all(isinstance(m, KeySpans if layout.startswith("ring_attn") else torch.Tensor) for m in masks), masks
    _reference_step(reference, expected)
    hybrid_test_helpers.compare_parameters(boosted, reference, plugin, rtol=PARAM_TOL, atol=PARAM_TOL)


@distributed(world_size=(2, 4))
def test_plugins_packed_documents_ep2(rank: int, world_size: int) -> None:
    """ep 2 (data parallel over the ep ranks: one window each) with a tiny Mixtral, experts split over ep; on 4 ranks
    with sp 2 ring_attn as well (each rank routes its sequence shard; attention masked by key spans)."""
    sp: dict[str, Any] = {}
    if world_size == 4:
        sp = {"sp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "ring_attn"}
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32", **sp)
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    assert dp_size == 2
    docs = documents()
    mine = packed_batch(docs[dp_rank : dp_rank + 1])
    model = mixtral()
    reference = copy.deepcopy(model)
    booster, boosted, optimizer = _boost(plugin, model)
    masks = _record_masks(boosted)
    loss = boosted(**mine).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    window_losses = [per_document_loss(reference, docs[w : w + 1]) for w in range(2)]
    assert abs(float(loss) - float(window_losses[dp_rank])) < LOSS_TOL, (float(loss), float(window_losses[dp_rank]))
    assert all(isinstance(m, KeySpans if sp else torch.Tensor) for m in masks), masks
    _reference_step(reference, torch.stack(window_losses).mean())
    moe_hybrid_test_helpers.compare_parameters(boosted, reference, plugin, PARAM_TOL)


@distributed(world_size=2)
@pytest.mark.parametrize("plugin_name", ["torch_ddp", "torch_fsdp", "zero2", "gemini"])
def test_plugins_packed_documents_data_parallel(rank: int, world_size: int, plugin_name: str) -> None:
    """The data-parallel plugins run transformers' own forward: each rank's window (one each) has its documents'
    token mean, and one SGD step on the mean of the two equals one process's on the per-document losses."""
    booster = Booster(plugin=TorchFSDPPlugin() if plugin_name == "torch_fsdp" else make_plugin(plugin_name))
    docs = documents()
    model = llama()
    reference = copy.deepcopy(model)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert optimizer is not None
    loss = boosted(**packed_batch(docs[rank : rank + 1])).loss
    booster.backward(loss, optimizer)
    optimizer.step()
    window_losses = [per_document_loss(reference, docs[w : w + 1]) for w in range(2)]
    assert abs(float(loss) - float(window_losses[rank])) < LOSS_TOL, (float(loss), float(window_losses[rank]))
    _reference_step(reference, torch.stack(window_losses).mean())
    state, want = full_state(boosted), reference.state_dict()
    for name, value in want.items():
        mine = state[name]
        mine = mine.full_tensor() if isinstance(mine, DTensor) else mine  # FSDP's shards
        torch.testing.assert_close(mine.float(), value, rtol=PARAM_TOL, atol=PARAM_TOL, msg=name)


def test_gpt_packed_batch_one_process_matches_documents() -> None:
    """cx's GPT: restarting position_ids give the block-diagonal causal mask and per-document positions (loss and one
    SGD step equal the documents one at a time); without them, or with positions that never restart, the mask is None
    (SDPA's is_causal path) and the documents leak into each other."""
    docs = documents()
    batch = packed_batch(docs)
    model, reference = gpt(), gpt()
    loss = model(**batch)
    expected = gpt_per_document_loss(reference, docs)
    assert abs(float(loss.detach()) - float(expected.detach())) < LOSS_TOL, (
        float(loss.detach()),
        float(expected.detach()),
    )
    with torch.no_grad():
        leaked = float(model(batch["input_ids"], labels=batch["labels"]))
    assert abs(leaked - float(expected.detach())) > 50 * LOSS_TOL
    assert document_mask(None) is None
    assert document_mask(torch.arange(32).expand(2, 32)) is None
    mask = document_mask(batch["position_ids"])
    assert mask is not None
    assert mask.shape == (2, 1, 32, 32)
    assert mask.dtype == torch.bool
    _reference_step(model, loss)
    _reference_step(reference, expected)
    for (name, param), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(param, want, rtol=PARAM_TOL, atol=PARAM_TOL, msg=name)


GPT_LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "num_microbatches": 2},
    "pp2_interleaved": {"pp_size": 2, "num_microbatches": 2, "pp_style": "interleaved", "num_model_chunks": 2},
    "pp2_zbv": {"pp_size": 2, "num_microbatches": 2, "pp_style": "zbv", "num_model_chunks": 2},
}


@distributed(world_size=2)
@pytest.mark.parametrize("layout", list(GPT_LAYOUTS))
def test_plugins_packed_documents_gpt(rank: int, world_size: int, layout: str) -> None:
    """cx's GPT under tp 2 / pp 2: every attention call gets the documents' mask (every pipeline stage builds it from
    the micro-batch's position_ids), and the loss and parameters after one SGD step match one process's documents."""
    plugin = HybridParallelPlugin(precision="fp32", **{"tp_size": 1, "pp_size": 1, **GPT_LAYOUTS[layout]})
    docs = documents()
    batch = packed_batch(docs)
    model, reference = gpt(), gpt()
    booster, boosted, optimizer = _boost(plugin, model)
    masks: list[Any] = []
    for name, module in boosted.unwrap().named_modules():
        if name.endswith(".attention"):
            module.register_forward_pre_hook(lambda _, args: masks.append(args[1] if len(args) > 1 else None))
    if plugin.pp_size > 1:
        total = counted(docs)

        def criterion(outputs: Any, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
            mine = int((micro_batch["labels"][:, 1:] != -100).sum())
            return cast(torch.Tensor, outputs * (mine * 2 / total))

        result = booster.execute_pipeline(iter([batch]), boosted, criterion, optimizer, return_loss=True)
        loss = result["loss"]
    else:
        loss = boosted(**batch)
        booster.backward(loss, optimizer)
    optimizer.step()
    expected = gpt_per_document_loss(reference, docs)
    if loss is not None:  # pp: the last stage holds it
        assert abs(float(loss.detach()) - float(expected.detach())) < LOSS_TOL, (layout, float(loss), float(expected))
    assert masks, "the attention modules ran"
    assert all(isinstance(m, torch.Tensor) and m.dtype == torch.bool for m in masks), masks
    _reference_step(reference, expected)
    hybrid_test_helpers.compare_parameters(boosted, reference, plugin, rtol=PARAM_TOL, atol=PARAM_TOL)


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["split_gather", "ring_attn"])
def test_plugins_packed_documents_gpt_refuses_sp(rank: int, world_size: int, mode: str) -> None:
    """cx's GPT has no sequence parallelism: boosting it under sp refuses by name (never trains packed rows wrong)."""
    sizes: dict[str, Any] = (
        {"tp_size": 2, "pp_size": 1} if mode == "split_gather" else {"tp_size": 1, "pp_size": 1, "sp_size": 2}
    )
    plugin = HybridParallelPlugin(
        precision="fp32", enable_sequence_parallelism=True, sequence_parallelism_mode=mode, **sizes
    )
    model = gpt()
    with pytest.raises(NotImplementedError, match="sequence parallelism is not implemented"):
        Booster(plugin=plugin).boost(model, torch.optim.SGD(model.parameters(), lr=LR))
