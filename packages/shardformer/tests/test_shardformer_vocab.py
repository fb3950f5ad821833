"""VocabParallelEmbedding1D, VocabParallelLMHead1D (vocabulary 13 padded to 16 over 2 ranks; padding never in the
state dict) and cross_entropy_1d (ignore_index, padded columns) against the plain modules and F.cross_entropy; ids and
labels outside the vocabulary raise as torch does; embedding subclasses other than a scaled lookup are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cx_mesh.testing import distributed
from cx_shardformer import VocabParallelEmbedding1D, VocabParallelLMHead1D, cross_entropy_1d
from shardformer_helpers import assert_close, chunk, full_grad

V, H, B, S = 13, 6, 2, 5


def _ids() -> torch.Tensor:
    torch.manual_seed(2)
    return torch.randint(0, V, (B, S))


@distributed(world_size=2)
def test_shardformer_vocab_embedding_matches_plain(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    plain = nn.Embedding(V, H, padding_idx=3)
    ref = copy.deepcopy(plain)
    weight = plain.weight
    layer = VocabParallelEmbedding1D.from_native_module(plain, None, make_vocab_size_divisible_by=4)
    assert layer.weight is weight
    assert weight.shape == (16 // world_size, H)
    if rank == world_size - 1:
        assert torch.count_nonzero(weight[V - 8 :]) == 0, "padding rows are zeros"
    assert layer.state_dict()["weight"].shape == (V, H)
    assert_close(layer.state_dict()["weight"], ref.weight.detach(), "state_dict")

    ids = _ids()
    g = torch.randn(B, S, H)
    out = layer(ids)
    expected = ref(ids)
    assert_close(out, expected.detach(), "embedding output")
    (out * g).sum().backward()
    (expected * g).sum().backward()
    assert ref.weight.grad is not None
    assert_close(full_grad(weight), ref.weight.grad, "embedding grad (padding_idx row has none)")

    other = nn.Embedding(V, H)
    other.load_state_dict(layer.state_dict())
    torch.manual_seed(7)
    fresh = nn.Embedding(V, H)
    layer.load_state_dict(fresh.state_dict())
    assert_close(layer(ids), fresh(ids).detach(), "after loading a plain state dict")


@distributed(world_size=2)
@pytest.mark.parametrize("gather_output", [True, False])
def test_shardformer_vocab_lm_head_matches_plain(rank: int, world_size: int, gather_output: bool) -> None:
    torch.manual_seed(0)
    plain = nn.Linear(H, V, bias=False)
    ref = copy.deepcopy(plain)
    head = VocabParallelLMHead1D.from_native_module(
        plain, None, make_vocab_size_divisible_by=4, gather_output=gather_output
    )
    assert head.weight is plain.weight
    assert plain.weight.shape == (8, H)
    assert head.state_dict()["weight"].shape == (V, H)

    torch.manual_seed(3)
    x = torch.randn(B, S, H)
    labels = _ids()
    labels[0, :2] = -100
    x_ref, x_in = x.clone().requires_grad_(), x.clone().requires_grad_()
    logits_ref = ref(x_ref)
    loss_ref = F.cross_entropy(logits_ref.view(-1, V), labels.view(-1), ignore_index=-100)
    logits = head(x_in)
    if gather_output:
        assert logits.shape == (B, S, V)
        assert_close(logits, logits_ref.detach(), "gathered logits, padding cut off")
        loss = F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100)
    else:
        assert logits.shape == (B, S, 8)
        real = min(8, V - 8 * rank)
        assert_close(logits[..., :real], logits_ref[..., 8 * rank : 8 * rank + real].detach(), "local logits")
        loss = cross_entropy_1d(logits, labels, ignore_index=-100, vocab_size=V)
    assert_close(loss, loss_ref.detach(), "loss")
    loss.backward()
    loss_ref.backward()
    assert x_in.grad is not None
    assert x_ref.grad is not None
    assert ref.weight.grad is not None
    assert_close(x_in.grad, x_ref.grad, "input grad")
    assert_close(full_grad(head.weight), ref.weight.grad, "weight grad")
    if rank == world_size - 1:
        assert head.weight.grad is not None
        assert torch.count_nonzero(head.weight.grad[V - 8 :]) == 0, "padding rows get no gradient"


@distributed(world_size=2)
@pytest.mark.parametrize("ignore_index", [-100, 4])
@pytest.mark.parametrize("mode", ["mean", "sum"])
def test_shardformer_cross_entropy_1d(rank: int, world_size: int, ignore_index: int, mode: str) -> None:
    torch.manual_seed(4)
    full = torch.randn(7, 16) * 3
    labels = torch.randint(0, V, (7,))
    labels[1] = ignore_index
    labels[5] = ignore_index
    ref_logits = full[:, :V].clone().requires_grad_()
    expected = F.cross_entropy(ref_logits, labels, ignore_index=ignore_index, reduction=mode)
    expected.backward()
    local = chunk(full, -1, rank, world_size).requires_grad_()  # columns 13..15 are padding: garbage, masked
    loss = cross_entropy_1d(local, labels, ignore_index=ignore_index, vocab_size=V, mode=mode)
    assert_close(loss, expected.detach(), "loss")
    loss.backward()
    assert local.grad is not None
    assert ref_logits.grad is not None
    padded_grad = torch.cat([ref_logits.grad, torch.zeros(7, 3)], -1)
    assert_close(local.grad, chunk(padded_grad, -1, rank, world_size), "logit grads (zero on padding)")


@distributed(world_size=2)
def test_shardformer_tied_embedding_and_head_share_one_shard(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    embed = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = embed.weight
    ref_embed, ref_head = copy.deepcopy(embed), copy.deepcopy(head)
    ref_head.weight = ref_embed.weight
    p_embed = VocabParallelEmbedding1D.from_native_module(embed, make_vocab_size_divisible_by=4)
    p_head = VocabParallelLMHead1D.from_native_module(head, make_vocab_size_divisible_by=4)
    assert p_embed.weight is p_head.weight
    assert p_embed.weight.shape == (8, H)
    ids = _ids()
    loss = cross_entropy_1d(p_head(p_embed(ids)), ids, vocab_size=V)
    ref_loss = F.cross_entropy(ref_head(ref_embed(ids)).view(-1, V), ids.view(-1))
    assert_close(loss, ref_loss.detach(), "tied loss")
    loss.backward()
    ref_loss.backward()
    assert ref_embed.weight.grad is not None
    assert_close(full_grad(p_embed.weight), ref_embed.weight.grad, "tied grad (embedding + head)")


@distributed(world_size=2)
@pytest.mark.parametrize("bad", [V, -1, 300])
def test_shardformer_vocab_embedding_rejects_ids_outside_vocabulary(rank: int, world_size: int, bad: int) -> None:
    """An id no rank owns raises on every rank (as F.embedding does), not a zero embedding; padding rows (13..15
    exist in the shards) are outside the vocabulary too."""
    torch.manual_seed(0)
    layer = VocabParallelEmbedding1D.from_native_module(nn.Embedding(V, H), None, make_vocab_size_divisible_by=4)
    ids = _ids()
    ids[1, 2] = bad
    with pytest.raises(IndexError, match=f"input id {bad} is outside the vocabulary of size {V}"):
        layer(ids)
    assert layer(_ids()).shape == (B, S, H), "in-range ids still work"


@distributed(world_size=2)
@pytest.mark.parametrize(("bad", "ignore_index"), [(V, -100), (-1, -100), (300, -100), (-100, 4)])
def test_shardformer_cross_entropy_1d_rejects_labels_outside_vocabulary(
    rank: int, world_size: int, bad: int, ignore_index: int
) -> None:
    """A label no rank owns raises on every rank (as F.cross_entropy does), not a loss of 0 or inf; ignore_index
    (in or out of the vocabulary) is still skipped, and -100 is an error when it is not the ignore_index."""
    torch.manual_seed(4)
    local = chunk(torch.randn(7, 16), -1, rank, world_size)
    labels = torch.randint(0, V, (7,))
    labels[1] = ignore_index
    labels[3] = bad
    with pytest.raises(IndexError, match=f"label {bad} is outside the vocabulary of size {V}"):
        cross_entropy_1d(local, labels, ignore_index=ignore_index, vocab_size=V)
    labels[3] = V - 1
    assert torch.isfinite(cross_entropy_1d(local, labels, ignore_index=ignore_index, vocab_size=V))


class _ShiftedEmbedding(nn.Embedding):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) + 1.0


class _ScaledWordEmbedding(nn.Embedding):  # transformers' pattern (Gemma, BART): the lookup times embed_scale
    embed_scale: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, embed_scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * self.embed_scale.to(self.weight.dtype)


@distributed(world_size=2)
def test_shardformer_vocab_embedding_subclasses(rank: int, world_size: int) -> None:
    """A scaled word embedding keeps its scale (and its state dict); any other forward override is refused by name
    rather than silently dropped."""
    torch.manual_seed(0)
    scaled = _ScaledWordEmbedding(V, H, 2.5)
    ref = copy.deepcopy(scaled)
    layer = VocabParallelEmbedding1D.from_native_module(scaled, None, make_vocab_size_divisible_by=4)
    assert_close(layer(_ids()), ref(_ids()).detach(), "scaled embedding")
    assert set(layer.state_dict()) == set(ref.state_dict()) == {"weight"}
    with pytest.raises(TypeError, match=r"_ShiftedEmbedding overrides nn\.Embedding\.forward"):
        VocabParallelEmbedding1D.from_native_module(_ShiftedEmbedding(V, H), None)
