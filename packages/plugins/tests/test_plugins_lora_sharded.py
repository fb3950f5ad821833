"""LoRA (peft) on sharded models against single-process peft training: HybridParallelPlugin with zero-1 data
parallelism, a pipeline split, and tensor parallelism (ShardFormer shards each LoRA layer's adapters with its base:
lora_B's rows under a column-parallel base, lora_A's columns under a row-parallel one); GeminiPlugin (frozen base
weights in chunks without gradients, adapters in trained chunks), also with tensor parallelism. Losses and adapters
after 3 AdamW steps match the reference within fp32 rounding; `save_lora_as_pretrained` writes peft's format,
gathered from every stage and slice, and `PeftModel.from_pretrained` on one process gives the reference's outputs.
Skipped without transformers / peft."""

from __future__ import annotations

import copy
import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, distributed, tiny_model_adam_tolerance
from cx_plugins import Booster, DPPluginBase, GeminiPlugin, HybridParallelPlugin, MoeHybridParallelPlugin, Plugin
from cx_plugins.gemini._plugin import GeminiModel

HAVE_PEFT = all(importlib.util.find_spec(name) is not None for name in ("transformers", "peft"))
transformers: Any = importlib.import_module("transformers") if HAVE_PEFT else None
peft: Any = importlib.import_module("peft") if HAVE_PEFT else None
needs_peft = pytest.mark.skipif(not HAVE_PEFT, reason="needs transformers and peft")

STEPS, BATCH, LENGTH, VOCAB, LR = 3, 4, 8, 64, 1e-2
# the runs differ from the reference only in summation order (data-parallel means, tensor-parallel partial sums):
# rounding alone, bounded for AdamW at TEST_ADAM_EPS over these steps and tokens
ATOL = tiny_model_adam_tolerance(LR, steps=STEPS, tokens=BATCH * LENGTH)
RTOL = 1e-5
LOSS_TOL = 1e-5  # a mean of O(1) fp32 terms over the batch's tokens


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=LENGTH, num_hidden_layers=2, use_cache=False, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _config() -> object:
    # every linear of the decoder: column-parallel (q, k, v, gate, up) and row-parallel (o, down) bases under tp.
    # init_lora_weights=False: non-zero B matrices, so the adapters change the output from the first step.
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, lora_dropout=0.0, init_lora_weights=False)


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _loss(outputs: Any, _batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


LAYOUTS: dict[str, Callable[[], Plugin]] = {
    "hybrid_pp2": lambda: HybridParallelPlugin(precision="fp32", tp_size=1, pp_size=2, num_microbatches=2),
    "hybrid_zero1_dp2": lambda: HybridParallelPlugin(precision="fp32", tp_size=1, pp_size=1, zero_stage=1),
    "hybrid_tp2": lambda: HybridParallelPlugin(precision="fp32", tp_size=2, pp_size=1),
    # small chunks: the tiny model spans several frozen and several trained chunks
    "gemini_dp2": lambda: GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 1024}),
    "gemini_tp2": lambda: GeminiPlugin(precision="fp32", chunk_config_dict={"chunk_size": 1024}, tp_size=2),
}


@needs_peft
@distributed(world_size=2)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_lora_matches_single_process_peft(rank: int, world_size: int, layout: str, tmp_path: Path) -> None:
    plugin = LAYOUTS[layout]()
    assert isinstance(plugin, DPPluginBase)
    booster = Booster(plugin=plugin)
    torch.manual_seed(1)
    model = booster.enable_lora(_llama(), lora_config=_config())
    reference = copy.deepcopy(model)
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    trainable = [p for p in model.parameters() if p.requires_grad]
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(trainable, lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    if isinstance(boosted, GeminiModel):  # the frozen base weights in chunks of their own: never reduced, no master
        frozen = boosted.ddp.manager.chunks("frozen")
        assert frozen
        for name, param in boosted.unwrap().named_parameters():
            in_frozen = any(boosted.ddp.manager.get_chunk(param) is chunk for chunk in frozen)
            assert in_frozen == (not param.requires_grad), name
    ref_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, eps=TEST_ADAM_EPS)
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = BATCH // dp_size
    data = torch.randint(0, VOCAB, (STEPS, BATCH, LENGTH), generator=torch.Generator().manual_seed(5))
    for full in data:
        mine = {"input_ids": full[dp_rank * share : (dp_rank + 1) * share]}
        mine["labels"] = mine["input_ids"]
        with torch.no_grad():
            expected = float(reference(**mine).loss)
        if plugin.supports_pipeline():
            loss = booster.execute_pipeline(iter([mine]), boosted, _loss, optimizer, return_loss=True)["loss"]
        else:
            loss = boosted(**mine).loss
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        reference(input_ids=full, labels=full).loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if loss is not None:  # the last pipeline stage's ranks
            assert abs(float(loss) - expected) <= LOSS_TOL * max(1.0, abs(expected)), (float(loss), expected)

    probe = {"input_ids": data[0], "labels": data[0]}
    if not plugin.supports_pipeline():  # the trained model as a whole (frozen base included) is the reference's
        with torch.no_grad():
            got_loss, want_loss = float(boosted(**probe).loss), float(reference(**probe).loss)
        assert abs(got_loss - want_loss) <= LOSS_TOL * max(1.0, abs(want_loss)), (got_loss, want_loss)

    target = tmp_path / "adapter"
    booster.save_lora_as_pretrained(boosted, target)
    assert (target / "adapter_model.safetensors").is_file()
    assert (target / "adapter_config.json").is_file()
    loaded = peft.PeftModel.from_pretrained(_llama(), str(target))
    want = _adapters(reference)
    got = _adapters(loaded)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=RTOL, atol=ATOL, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(loaded(**probe).logits, reference(**probe).logits, rtol=1e-4, atol=1e-4)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


@needs_peft
@distributed(world_size=2)
def test_sharded_lora_refusals_name_the_layer(rank: int, world_size: int) -> None:
    """What tensor parallelism cannot shard consistently is refused at boost, naming the layer and the reason."""
    fused = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    booster = Booster(plugin=HybridParallelPlugin(precision="fp32", tp_size=2, pp_size=1))
    with pytest.raises(NotImplementedError, match=r"h\.0\.attn\.c_attn: LoRA adapters on a GPT2FusedLinearConv1D_Col"):
        booster.boost(booster.enable_lora(_gpt2(), lora_config=fused))
    dropping = peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=0.1)
    booster = Booster(plugin=HybridParallelPlugin(precision="fp32", tp_size=2, pp_size=1))
    with pytest.raises(NotImplementedError, match="lora_dropout > 0 under tensor parallelism"):
        booster.boost(booster.enable_lora(_llama(), lora_config=dropping))
    moe = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="fp32")
    with pytest.raises(NotImplementedError, match="MoeHybridParallelPlugin does not support LoRA"):
        Booster(plugin=moe).enable_lora(_llama(), lora_config=_config())
