"""Dropout random streams (`_rng`, wired by `policies/_dropout`): dropout on sharded activations draws a different
mask on every rank holding another shard, dropout on replicated activations the same mask on every rank, checkpointed
recomputation replays the masks, and calls that draw nothing consume no random numbers.

On 2 ranks with a tiny GPT-2 (dropout 0.5 everywhere, eager attention so that the attention-probability dropout is a
visible `F.dropout` call): every dropout call's mask is recorded and compared across ranks. Before the streams,
heads h and h + heads/tp shared one mask and split_gather's sequence shards shared one too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from cx_mesh.testing import distributed
from cx_shardformer import GradientCheckpointConfig, ShardConfig, ShardFormer
from cx_shardformer._rng import DropoutStream, add_dropout_region, dropout_region
from shardformer_helpers import assert_close, full_grad
from shardformer_models import build, tokens

RANK0, RANK1 = DropoutStream("s", ((0, 2),)), DropoutStream("s", ((1, 2),))


def _dropped(stream: DropoutStream | None, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    with dropout_region(stream):
        return F.dropout(torch.ones(32, 32), 0.5)


def test_shardformer_dropout_streams_differ_per_shard_and_repeat() -> None:
    assert torch.equal(_dropped(RANK0), _dropped(RANK0)), "a stream is a function of the default generator's state"
    assert not torch.equal(_dropped(RANK0), _dropped(RANK1)), "ranks holding different shards draw different masks"
    assert not torch.equal(_dropped(RANK0), _dropped(None)), "a sharded stream is not the replicated one"
    assert torch.equal(_dropped(None), _dropped(None, seed=0))
    torch.manual_seed(0)
    plain = F.dropout(torch.ones(32, 32), 0.5)
    assert torch.equal(_dropped(None), plain), "the replicated stream is the default generator"
    # SDPA's dropout_p (the Ulysses attention) runs under the stream too
    q = torch.randn(1, 2, 8, 4)
    outs = []
    for stream in (RANK0, RANK0, RANK1):
        torch.manual_seed(0)
        with dropout_region(stream):
            outs.append(F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_shardformer_dropout_that_draws_nothing_consumes_nothing() -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 2, 8, 4)
    state = torch.get_rng_state()
    with dropout_region(RANK0):
        F.dropout(x, 0.0)
        F.dropout(x, 0.5, training=False)
        nn.Dropout(0.0)(x)
        torch.dropout(x, 0.5, False)
        F.scaled_dot_product_attention(x, x, x)
    assert torch.equal(torch.get_rng_state(), state)


class _Block(nn.Module):
    """A sharded-stream dropout (in its own region) next to a replicated one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.sharded = nn.Dropout(0.5)
        add_dropout_region(self.sharded, RANK1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.sharded(self.linear(x)), 0.5) * 2


@pytest.mark.parametrize("reentrant", [False, True])
def test_shardformer_dropout_streams_replay_under_checkpoint(reentrant: bool) -> None:
    torch.manual_seed(0)
    block, base = _Block(), torch.randn(8, 16)
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    for checkpointed in (False, True):
        x = base.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        out = checkpoint(block, x, use_reentrant=reentrant) if checkpointed else block(x)
        assert isinstance(out, torch.Tensor)
        out.square().sum().backward()
        assert x.grad is not None
        assert block.linear.weight.grad is not None
        grads.append((x.grad, block.linear.weight.grad))
    for plain, recomputed in zip(*grads, strict=True):
        assert torch.equal(plain, recomputed), "recomputation drew the forward's masks again"


class _Recorder(TorchFunctionMode):
    """Every drawing F.dropout call's keep-mask, in call order (nn.Dropout and transformers' eager attention call
    it). Entered before the forward, so cx's dropout mode stacks above it and the call arrives here under its
    stream."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.dropout and kwargs.get("training", True) and kwargs.get("p", 0.5) > 0:
            self.masks.append((out != 0).detach().clone())
        return out


def _gathered(mask: torch.Tensor) -> list[torch.Tensor]:
    pieces = [torch.empty_like(mask) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, mask.contiguous())
    return pieces


def _gpt2(rate: float, mode: str, checkpointed: bool = False) -> Any:
    model = build("gpt2", attn_pdrop=rate, resid_pdrop=rate, embd_pdrop=rate)
    model.set_attn_implementation("eager")
    sp = mode != "tp"
    config = ShardConfig(
        enable_tensor_parallelism=mode in ("tp", "split_gather"),
        enable_sequence_parallelism=sp,
        sequence_parallelism_mode=mode if sp else None,
        gradient_checkpoint_config=GradientCheckpointConfig(1.0) if checkpointed else None,
    )
    model, _ = ShardFormer(config).optimize(model)
    return model.train()


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["tp", "split_gather", "all_to_all"])
def test_shardformer_dropout_masks_across_ranks(rank: int, world_size: int, mode: str) -> None:
    """Attention probabilities of this rank's heads and sequence shards: masks differ across ranks. The embedding
    dropout (before the split) and, under plain tp, the residual dropouts on all-reduced outputs: masks agree."""
    model = _gpt2(0.0, mode)
    ids = tokens(0)
    torch.manual_seed(0)
    state = torch.get_rng_state()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert torch.equal(torch.get_rng_state(), state), "dropout 0 consumes no random numbers"

    model = _gpt2(0.5, mode)
    torch.manual_seed(0)
    with _Recorder() as recorder:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    masks = recorder.masks
    losses = _gathered(loss.detach().reshape(1))
    assert torch.equal(losses[0], losses[1]), "every rank computes the same loss"
    embedding, *layers = masks
    assert torch.equal(*_gathered(embedding)), "replicated embedding dropout agrees across ranks"
    probs = [m for m in layers if m.dim() == 4]
    hidden = [m for m in layers if m.dim() == 3]
    assert len(hidden) == 4, f"two residual dropouts per layer: {[tuple(m.shape) for m in masks]}"
    assert len(probs) == (0 if mode == "all_to_all" else 2), "all_to_all's attention dropout runs inside SDPA"
    for mask in probs:
        first, second = _gathered(mask)
        assert not torch.equal(first, second), f"{mode}: attention heads of different ranks share a dropout mask"
    for mask in hidden:
        first, second = _gathered(mask)
        if mode == "tp":
            assert torch.equal(first, second), "tp: dropout on the replicated residual stream agrees across ranks"
        else:
            assert not torch.equal(first, second), f"{mode}: sequence shards of different ranks share a mask"


@distributed(world_size=2)
@pytest.mark.parametrize("mode", ["tp", "split_gather"])
def test_shardformer_dropout_checkpoint_recomputation_replays_masks(rank: int, world_size: int, mode: str) -> None:
    """Every decoder layer checkpointed: recomputation draws the forward's masks again, sharded streams included,
    so the gradients equal those of the run that kept its activations (the same computation, bit for bit)."""
    ids = tokens(1)
    grads = []
    for checkpointed in (False, True):
        model = _gpt2(0.5, mode, checkpointed)
        torch.manual_seed(3)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        grads.append({name: full_grad(p) for name, p in model.named_parameters()})
    plain, recomputed = grads
    for name, grad in plain.items():
        assert_close(recomputed[name], grad, f"{mode}: checkpointed grad of {name}", rtol=0.0, atol=0.0)
