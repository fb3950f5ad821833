"""Shared pieces of the HybridParallelPlugin tests: tiny HF models built from a config, deterministic batches, and a
runner that trains the boosted model and a single-process copy side by side on the same data.

Data-parallel semantics: the global batch is split over the dp ranks and (with pp) into micro-batches; every piece
has the same number of tokens, so the mean of the pieces' mean losses is the full batch's mean loss, which the
reference trains on. Parameters are compared at the end by name, tensor-parallel shards gathered with
`unshard_tensor`, each pipeline stage comparing the parameters it holds.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin
from cx_plugins._layout import Axis
from cx_shardformer import get_shard_spec, unshard_tensor

VOCAB, BATCH, LENGTH, LR = 64, 8, 8, 0.1


def llama(layers: int = 4) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, num_hidden_layers=layers, use_cache=False, attention_dropout=0.0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2(layers: int = 4) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=4, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(100 + step))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss(outputs: Any, _micro_batch: Any) -> torch.Tensor:
    loss: torch.Tensor = outputs.loss
    return loss


@dataclass
class Outcome:
    losses: list[float] = field(default_factory=list)
    reference_losses: list[float] = field(default_factory=list)
    norms: list[float | None] = field(default_factory=list)
    reference_norms: list[float] = field(default_factory=list)


def train_and_compare(
    plugin: HybridParallelPlugin,
    model_fn: Callable[[], nn.Module] = llama,
    steps: int = 5,
    clip: float = 0.0,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    loss_rtol: float = 1e-4,
) -> Outcome:
    """Train `steps` steps with the plugin and a single-process copy; assert losses and final parameters match."""
    model = model_fn()
    reference = copy.deepcopy(model)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    assert isinstance(boosted, HybridParallelModule)
    assert optimizer is not None
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()
    share = BATCH // dp_size
    outcome = Outcome()
    for step in range(steps):
        full = batch(step)
        mine = {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in full.items()}
        with torch.no_grad():
            expected_local = float(reference(**mine).loss)
        if plugin.pp_size > 1:
            result = booster.execute_pipeline(iter([mine]), boosted, _loss, optimizer, return_loss=True)
            loss = result["loss"]
        else:
            loss = boosted(**mine).loss
            booster.backward(loss, optimizer)
        if clip > 0:
            outcome.norms.append(float(optimizer.clip_grad_by_norm(clip)))
        optimizer.step()
        optimizer.zero_grad()
        reference(**full).loss.backward()
        if clip > 0:
            outcome.reference_norms.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)))
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        if loss is not None:
            outcome.losses.append(float(loss))
            outcome.reference_losses.append(expected_local)
    if outcome.losses:
        torch.testing.assert_close(
            torch.tensor(outcome.losses), torch.tensor(outcome.reference_losses), rtol=loss_rtol, atol=loss_rtol
        )
    if clip > 0:
        torch.testing.assert_close(
            torch.tensor(outcome.norms), torch.tensor(outcome.reference_norms), rtol=loss_rtol, atol=1e-6
        )
    compare_parameters(boosted, reference, plugin, rtol, atol)
    return outcome


def compare_parameters(
    boosted: HybridParallelModule, reference: nn.Module, plugin: HybridParallelPlugin, rtol: float, atol: float
) -> None:
    expected = dict(reference.named_parameters())
    held = boosted.held_parameter_names()
    assert held, "every rank holds part of the model"
    tp_group = plugin.layout.group(Axis.TP)
    for name, param in boosted.unwrap().named_parameters():
        if name not in held:
            assert param.device.type == "meta", f"{name} belongs to another stage and should be released"
            continue
        spec = get_shard_spec(param)
        full = unshard_tensor(param.detach(), spec, tp_group) if spec is not None else param.detach()
        torch.testing.assert_close(full.float(), expected[name].detach(), rtol=rtol, atol=atol, msg=_named(name))


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"
