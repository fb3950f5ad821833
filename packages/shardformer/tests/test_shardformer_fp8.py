"""ShardConfig's use_fp8 and fp8_communication on 2 ranks.

- use_fp8: ShardFormer turns on `cx_mesh.fp8.fp8_linear` in exactly the TP layers whose local shard `fp8_eligible`
  accepts (Llama's attention; its MLP shards of 24 features stay high precision; lm_head excluded), and in GPT-2's
  Conv1D layers; the forward hits fp8_linear once per such layer.
- fp8_communication: every TP collective of a column/row pair (the row output's all-reduce, the column input
  gradient's all-reduce, the column output's gather, split_gather's all-gathers and reduce-scatters) and the Ulysses
  all-to-alls hand over exactly the bytes of cx_mesh.fp8's collectives (half of bf16 plus 4 per scale; an fp8
  all-reduce is a reduce-scatter and an all-gather). So does the vocabulary-parallel embedding's forward all-reduce
  (as ColossalAI's), while the vocabulary-parallel cross entropy's three reductions stay plain float32 all-reduces.
Training against bf16 is tested under HybridParallelPlugin (packages/plugins/tests/test_plugins_hybrid_fp8.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cx_shardformer._conv1d as conv1d_module
import cx_shardformer._fp8 as fp8_module
from cx_mesh.fp8 import Fp8Options
from cx_mesh.testing import count_collective_bytes, distributed
from cx_shardformer import Linear1D_Col, Linear1D_Row, ShardConfig, ShardFormer, VocabParallelEmbedding1D
from shardformer_helpers import chunk
from shardformer_models import VOCAB, build

B, S, H = 2, 8, 64
W = 2  # ranks


_FP8_LINEAR = "fp8_linear"  # the name the Linear (_fp8) and Conv1D (_conv1d) paths call


@contextmanager
def _fp8_calls() -> Iterator[list[str]]:
    """The weight shapes of every fp8_linear call the TP layers make (Linear and Conv1D paths)."""
    calls: list[str] = []
    modules = (fp8_module, conv1d_module)
    original = getattr(fp8_module, _FP8_LINEAR)

    def spy(x: torch.Tensor, weight: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(f"{tuple(weight.shape)}")
        out: torch.Tensor = original(x, weight, *args)
        return out

    for module in modules:
        setattr(module, _FP8_LINEAR, spy)
    try:
        yield calls
    finally:
        for module in modules:
            setattr(module, _FP8_LINEAR, original)


def _gather(n: int) -> tuple[int, int]:
    """(bf16, fp8) bytes this rank hands to an all-gather of its n elements: one message, one scale."""
    return 2 * n, n + 4


def _reduce_scatter(n: int) -> tuple[int, int]:
    """... to a reduce-scatter of n elements: one message and scale per destination rank."""
    return 2 * n, n + 4 * W


def _all_reduce(n: int) -> tuple[int, int]:
    """... to an all-reduce of n elements; cx_mesh.fp8's is a reduce-scatter then an all-gather of the n/W sum."""
    return 2 * n, n + 4 * W + n // W + 4


def _pair(seq_mode: str | None, gather_output: bool) -> tuple[Linear1D_Col, Linear1D_Row | None]:
    torch.manual_seed(0)
    col = Linear1D_Col.from_native_module(
        nn.Linear(H, H).to(torch.bfloat16), None, seq_parallel_mode=seq_mode, gather_output=gather_output
    )
    if gather_output:
        return col, None
    row = Linear1D_Row.from_native_module(nn.Linear(H, H).to(torch.bfloat16), None, seq_parallel_mode=seq_mode)
    return col, row


def _run_pair(rank: int, seq_mode: str | None, gather_output: bool, fp8: bool) -> tuple[int, torch.Tensor]:
    col, row = _pair(seq_mode, gather_output)
    for layer in (col, row):
        if layer is not None:
            layer.fp8_communication = fp8  # what ShardFormer sets from ShardConfig.fp8_communication
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x = (chunk(x, 1, rank, W) if seq_mode else x).requires_grad_()
    with count_collective_bytes() as counted:
        out = col(x) if row is None else row(col(x))
        out.float().square().sum().backward()
    return counted.total, out.detach().float()


CASES = {  # (seq_mode, gather_output): the collectives the forward and backward make, as (bf16, fp8) bytes
    (None, False): [_all_reduce(B * S * H), _all_reduce(B * S * H)],  # row output; column input gradient
    (None, True): [_gather(B * S * H // W), _all_reduce(B * S * H)],  # column output; column input gradient
    ("split_gather", False): [  # column: gather input / reduce-scatter its gradient; row: the converse
        _gather(B * S * H // W),
        _reduce_scatter(B * S * H),
        _reduce_scatter(B * S * H),
        _gather(B * S * H // W),
        (2 * H, 2 * H),  # the row bias's gradient, summed over the sequence shards: a parameter gradient, not fp8
    ],
}


@distributed(world_size=W)
def test_shardformer_fp8_communication_bytes_and_use_fp8_layers(rank: int, world_size: int) -> None:
    for (seq_mode, gather_output), collectives in CASES.items():
        plain_bytes, plain = _run_pair(rank, seq_mode, gather_output, fp8=False)
        fp8_bytes, out = _run_pair(rank, seq_mode, gather_output, fp8=True)
        case = f"seq_mode={seq_mode}, gather_output={gather_output}"
        assert plain_bytes == sum(b for b, _ in collectives), f"{case}: the plain path moved other bytes"
        assert fp8_bytes == sum(f for _, f in collectives), f"{case}: {fp8_bytes} fp8 bytes"
        assert bool(out.isfinite().all()), case  # fp8 numerics are cx_mesh's tests; training is the plugin's
        assert not torch.equal(out, plain), f"{case}: the fp8 path gave the plain result bit for bit"

    _check_use_fp8_llama()
    _check_use_fp8_gpt2()
    _check_ulysses_bytes(rank)
    _check_vocab_embedding_and_loss_bytes()


def _check_vocab_embedding_and_loss_bytes() -> None:
    """Llama tp 2: the embedding's all-reduce of its [B, S, H] partial sums goes fp8; with every TP collective in
    fp8, the plain all-reduces left are exactly the cross entropy's (row max, sum of exponentials, target logit:
    one float32 per label each), so the loss is computed from exact sums."""
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(4))
    by_op = []
    for fp8 in (False, True):
        model = build("llama", hidden_size=H, num_key_value_heads=4).to(torch.bfloat16)
        ShardFormer(ShardConfig(fp8_communication=fp8)).optimize(model)
        embedding = model.model.embed_tokens
        assert isinstance(embedding, VocabParallelEmbedding1D)
        assert embedding.fp8_communication is fp8
        with count_collective_bytes() as counted:
            model(input_ids=ids, labels=ids).loss.backward()
        by_op.append(counted.by_op)
        with count_collective_bytes() as counted:
            embedding(ids)
        assert counted.total == _all_reduce(B * S * H)[fp8], counted.by_op
    plain, compressed = by_op
    labels = B * S  # HF's causal LM loss pads the shifted labels back to S per row (the last one ignored)
    assert compressed.get("all_reduce") == 3 * 4 * labels, compressed
    assert plain["all_reduce"] > 3 * 4 * labels + 2 * B * S * H, plain  # the embedding's bf16 sum among them


def _check_use_fp8_llama() -> None:
    # intermediate 48: its tp shards have 24 features, not a multiple of 16, so the MLP stays high precision
    model = build("llama", hidden_size=H, intermediate_size=48, num_key_value_heads=4).to(torch.bfloat16)
    config = ShardConfig(use_fp8=True)
    ShardFormer(config).optimize(model)
    converted = sorted(n for n, m in model.named_modules() if getattr(m, "fp8_recipe", None) is not None)
    expected = sorted(f"model.layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkvo")
    assert converted == expected, converted
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    with _fp8_calls() as calls:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert len(calls) == len(expected), calls
    assert all(p.grad is None or bool(p.grad.isfinite().all()) for p in model.parameters())


def _check_use_fp8_gpt2() -> None:
    model = build("gpt2", n_embd=H).to(torch.bfloat16)
    ShardFormer(ShardConfig(use_fp8=True, fp8_options=Fp8Options(exclude=("lm_head", "mlp.c_proj")))).optimize(model)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(2))
    with _fp8_calls() as calls:
        model(input_ids=ids, labels=ids).loss.backward()
    # c_attn [64, 96] and attn.c_proj [32, 64] and mlp.c_fc [64, 128] per layer (Conv1D [in, out] seen as
    # [out, in]); mlp.c_proj excluded by name
    assert sorted(calls) == sorted(["(96, 64)", "(64, 32)", "(128, 64)"] * 2), calls


def _check_ulysses_bytes(rank: int) -> None:
    """Ulysses: 4 all-to-alls forward (q, k, v, output) and 4 backward per layer, each W messages and scales."""
    sent = []
    for fp8 in (False, True):
        model = build("llama", hidden_size=H, num_attention_heads=4, num_key_value_heads=4).to(torch.bfloat16)
        config = ShardConfig(
            enable_tensor_parallelism=False,
            enable_sequence_parallelism=True,
            sequence_parallelism_mode="all_to_all",
            fp8_communication=fp8,
        )
        ShardFormer(config).optimize(model)
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
        with count_collective_bytes() as counted:
            model(input_ids=ids, labels=ids).loss.backward()
        sent.append(counted.by_op.get("all_to_all_single", 0))
    plain, compressed = sent
    assert plain > 0
    assert compressed == plain // 2 + 4 * W * 8 * 2, (plain, compressed)
    dist.barrier()


def test_shardformer_fp8_switches_without_their_layers_or_collectives_raise() -> None:
    with pytest.raises(TypeError, match=r"fp8_options must be a cx_mesh\.fp8\.Fp8Options"):
        ShardConfig(enable_tensor_parallelism=False, fp8_options="rowwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"use_fp8=True .* enable_tensor_parallelism is False"):
        ShardConfig(enable_tensor_parallelism=False, use_fp8=True)
    with pytest.raises(ValueError, match=r"fp8_communication=True .* both .* are False"):
        ShardConfig(enable_tensor_parallelism=False, fp8_communication=True)
    ShardConfig(  # Ulysses without tensor parallelism: its all-to-alls are what fp8_communication compresses
        enable_tensor_parallelism=False,
        enable_sequence_parallelism=True,
        sequence_parallelism_mode="all_to_all",
        fp8_communication=True,
    )
