"""Sequence parallelism at 2 ranks on tiny transformers models against the unsharded copy: split_gather (with tp 2),
all_to_all and ring (sp 2). The loss is the full-sequence loss, logits and every gradient equal, and two AdamW steps
give the same weights; GQA (key/value heads fewer than sp) under all_to_all; a sequence length that does not divide
fails clearly; a later pipeline stage takes its sequence shard (`shard_sequence_at_stage`). Skips without
transformers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, distributed, tiny_model_adam_tolerance
from cx_shardformer import ShardConfig, ShardFormer, shard_sequence_at_stage, zigzag_positions
from shardformer_helpers import assert_close
from shardformer_models import VOCAB, build, compare_grads, compare_state, full_logits, tokens, twin

pytest.importorskip("transformers")

CASES = [
    ("llama", "split_gather", {}),
    ("llama", "split_gather+parallel_output", {}),
    ("gpt2", "split_gather", {}),
    ("llama", "all_to_all", {}),
    ("llama", "all_to_all", {"num_key_value_heads": 1}),
    ("gpt2", "all_to_all", {}),
    ("llama", "ring", {}),
    ("gpt2", "ring", {}),
]


def _config(mode: str) -> ShardConfig:
    mode, _, extra = mode.partition("+")
    return ShardConfig(
        enable_tensor_parallelism=mode == "split_gather",
        enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode,
        parallel_output=extra == "parallel_output",
    )


@distributed(world_size=2)
@pytest.mark.parametrize(("kind", "mode", "overrides"), CASES)
def test_shardformer_sequence_parallel_matches_unsharded(
    rank: int, world_size: int, kind: str, mode: str, overrides: dict[str, int]
) -> None:
    model = build(kind, **overrides)
    reference = twin(model)
    config = _config(mode)
    model, _ = ShardFormer(config).optimize(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=TEST_ADAM_EPS)
    for step in range(2):
        ids = tokens(step)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        ref_out = reference(input_ids=ids, labels=ids, use_cache=False)
        logits = full_logits(out.logits, config.parallel_output)
        assert logits.shape == (ids.shape[0], ids.shape[1], VOCAB), "logits cover the full sequence"
        assert_close(out.loss, ref_out.loss.detach(), f"{kind} {mode} loss step {step}")
        assert_close(logits, ref_out.logits.detach(), f"{kind} {mode} logits step {step}")
        out.loss.backward()
        ref_out.loss.backward()
        if step == 0:
            compare_grads(model, reference, f"{kind} {mode}")
        optimizer.step()
        ref_optimizer.step()
    atol = tiny_model_adam_tolerance(1e-2, steps=2, tokens=ids.numel())  # AdamW at TEST_ADAM_EPS: rounding alone
    compare_state(model, reference, f"{kind} {mode} after 2 AdamW steps", rtol=1e-4, atol=atol)


@distributed(world_size=2)
@pytest.mark.parametrize(
    ("mode", "seq", "match"),
    [
        ("split_gather", 7, "not divisible by 2"),
        ("all_to_all", 7, "not divisible by 2"),
        ("ring", 6, "not divisible by 4"),
    ],
)
def test_shardformer_sequence_length_must_divide(rank: int, world_size: int, mode: str, seq: int, match: str) -> None:
    model, _ = ShardFormer(_config(mode)).optimize(build("llama"))
    ids = tokens(0, seq)
    with pytest.raises(ValueError, match=f"sequence length {seq} is {match}"):
        model(input_ids=ids, labels=ids, use_cache=False)


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring"])
def test_shardformer_sequence_parallel_with_padding_mask(rank: int, world_size: int, mode: str) -> None:
    """A right-padded batch (attention_mask zeros, labels -100): the full-sequence mask reaches every mode."""
    model = build("llama")
    reference = twin(model)
    model, _ = ShardFormer(_config(mode)).optimize(model)
    ids = tokens(4)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert_close(out.loss, ref_out.loss.detach(), f"{mode} padded loss")
    assert_close(out.logits, ref_out.logits.detach(), f"{mode} padded logits")
    out.loss.backward()
    ref_out.loss.backward()
    compare_grads(model, reference, f"{mode} padded")


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["split_gather", "all_to_all", "ring"])
def test_shardformer_sequence_parallel_with_left_padding(rank: int, world_size: int, mode: str) -> None:
    """A left-padded batch: the first query rows of a padded sequence have no key to attend to. Every mode gives the
    unsharded model's finite loss, logits and gradients (ring attention gave NaN everywhere: 0/0 in those rows)."""
    model = build("llama")
    reference = twin(model)
    model, _ = ShardFormer(_config(mode)).optimize(model)
    ids = tokens(5)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :1] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    ref_out = reference(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    assert bool(torch.isfinite(out.loss)), f"{mode} left-padded loss is {out.loss.item()}"
    assert_close(out.loss, ref_out.loss.detach(), f"{mode} left-padded loss")
    valid = mask.bool()
    assert_close(out.logits[valid], ref_out.logits.detach()[valid], f"{mode} left-padded logits")
    out.loss.backward()
    ref_out.loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{mode}: {name} has no grad"
        assert bool(torch.isfinite(param.grad).all()), f"{mode}: grad of {name} not finite"
    compare_grads(model, reference, f"{mode} left-padded")


class _LaterStage(nn.Module):
    """Stands in for a pipeline stage cut after the first decoder layer: it hands its input to its first layer, whose
    own forward is replaced by the identity (so the test sees exactly what the stage hooks give the layer)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.seen: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.seen = hidden_states
        out: torch.Tensor = self.layer(hidden_states)
        return out


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["all_to_all", "ring"])
def test_shardformer_sequence_stage_takes_its_shard(rank: int, world_size: int, mode: str) -> None:
    """`shard_sequence_at_stage`: a later stage widens the received shard to the full length at this rank's
    positions (zig-zag for ring) and its first layer narrows it back; the gradient passes straight through. No-ops and
    the clear errors for stages it cannot serve."""
    model, _ = ShardFormer(_config(mode)).optimize(build("llama", num_hidden_layers=2))
    layers = list(model.get_submodule("model.layers").children())
    hooks = [len(layer._forward_pre_hooks) for layer in layers]
    first = _LaterStage(layers[0])
    shard_sequence_at_stage(model, first)  # holds the first layer, which splits the sequence itself
    shard_sequence_at_stage(build("llama"), _LaterStage(layers[1]))  # a model without sequence parallelism
    assert not first._forward_pre_hooks
    assert [len(layer._forward_pre_hooks) for layer in layers] == hooks, "both are no-ops"
    with pytest.raises(ValueError, match="holds no decoder layer"):
        shard_sequence_at_stage(model, nn.Linear(2, 2))

    layer = layers[1]
    layer.forward = lambda hidden_states, **kwargs: hidden_states
    stage = _LaterStage(layer)
    shard_sequence_at_stage(model, stage)
    full = 8
    positions = zigzag_positions(full, rank, world_size) if mode == "ring" else torch.arange(rank * 4, rank * 4 + 4)
    shard = torch.randn(2, full // world_size, 3, requires_grad=True)
    out = stage(hidden_states=shard)
    assert stage.seen is not None
    assert stage.seen.shape == (2, full, 3)
    expected = torch.zeros(2, full, 3).index_copy(1, positions, shard.detach())
    assert torch.equal(stage.seen.detach(), expected), "the shard sits at this rank's positions, zeros elsewhere"
    assert torch.equal(out.detach(), shard.detach()), "the first layer gets the shard back"
    (out * 3.0).sum().backward()
    assert shard.grad is not None
    assert torch.equal(shard.grad, torch.full_like(shard, 3.0))
    with pytest.raises(TypeError, match="must receive the previous stage's output as the keyword hidden_states"):
        stage(shard)
