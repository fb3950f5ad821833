"""What the fp8 plugin tests share: a tiny HF Llama (hidden 32, 2 layers, every projection's dims multiples of 16)
and four fixed global batches cycled over the steps, so the model can learn them and the loss really falls (DDP,
FSDP); the exact bytes fp8_communication sends against the same run without it (hybrid, ZeRO, Gemini, MoE); the
parameters after the first optimizer step against the bf16 run's, within Adam's arithmetic (every fp8 test)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from cx_mesh import fp8 as cx_fp8
from cx_mesh.testing import CollectiveBytes, adam_step_tolerance, unit_roundoff

VOCAB, PER_RANK, LENGTH, BATCHES = 64, 2, 16, 4
E4M3_U, E4M3_TINY = 2.0**-4, 2.0**-9 / 448.0  # unit roundoff (3 mantissa bits); smallest subnormal over largest
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which every fp8 test keeps
SCALE_BYTES = 4  # one float32 scale per fp8 message
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
_REDUCE_SCATTERS = ("all_to_all_single", "reduce_scatter_single", "reduce_scatter_tensor")  # gloo: an all-to-all


def hybrid_fp8_llama(vocab: int, length: int) -> nn.Module:
    """The hybrid fp8 tests' model (hidden 64: wide enough for fp8's 16-aligned tp shards), seeded like `tiny_llama`."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=length, num_hidden_layers=2, use_cache=False, attention_dropout=0.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def tiny_llama() -> nn.Module:
    """The model, seeded: every call (and every rank) builds the same weights."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=LENGTH, num_hidden_layers=2, use_cache=False,
    )  # fmt: skip
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def cycled_batch(step: int, rank: int) -> torch.Tensor:
    """This rank's PER_RANK rows of global batch `step % BATCHES` (2 ranks)."""
    ids = torch.randint(0, VOCAB, (2 * PER_RANK, LENGTH), generator=torch.Generator().manual_seed(step % BATCHES))
    return ids[rank * PER_RANK : (rank + 1) * PER_RANK]


def assert_fp8_bytes(plain: CollectiveBytes, fp8: CollectiveBytes, group: int) -> None:
    """The bytes of a run with fp8_communication, exactly, from the same run without it (counts over `group` ranks,
    every bf16 payload's numel a multiple of it). cx_mesh.fp8 sends each message as its fp8 bytes (half the bf16
    ones) plus one 4-byte scale, packed as uint8: a bf16 reduce-scatter becomes an all-to-all of its numel plus
    `group` scales, a bf16 gather its slice plus one scale, and a bf16 all-reduce both of those (a reduce-scatter,
    then an all-gather of the reduced slice: numel / group plus one scale). Everything else (a loss's float32
    reductions, integer bookkeeping, float32 flags, raw bytes) travels byte for byte as without the switch."""
    rest = dict(plain.by_dtype)
    rest_calls = dict(plain.calls)
    to_all = gather = to_all_calls = gather_calls = 0
    for (op, dtype), nbytes in plain.by_dtype.items():
        if dtype != torch.bfloat16:
            continue
        payload, calls = nbytes // 2, plain.calls[op, dtype]
        del rest[op, dtype], rest_calls[op, dtype]
        if op == "all_reduce":
            to_all, to_all_calls = to_all + payload + SCALE_BYTES * group * calls, to_all_calls + calls
            gather, gather_calls = gather + payload // group + SCALE_BYTES * calls, gather_calls + calls
        elif op in _REDUCE_SCATTERS:
            to_all, to_all_calls = to_all + payload + SCALE_BYTES * group * calls, to_all_calls + calls
        else:
            assert op in _GATHERS, f"no fp8 counterpart for a bf16 {op}"
            gather, gather_calls = gather + payload + SCALE_BYTES * calls, gather_calls + calls
    gather_ops = {op for op, dtype in fp8.by_dtype if dtype == torch.uint8 and op in _GATHERS}
    assert len(gather_ops) <= 1, gather_ops
    expected, expected_calls = dict(rest), dict(rest_calls)
    added = {"all_to_all_single": (to_all, to_all_calls)}
    if gather_calls:
        (gather_op,) = gather_ops
        added[gather_op] = (gather, gather_calls)
    for op, (nbytes, calls) in added.items():
        if calls:  # on top of what the op already carried as uint8 (Gemini's raw-byte path check)
            expected[op, torch.uint8] = expected.get((op, torch.uint8), 0) + nbytes
            expected_calls[op, torch.uint8] = expected_calls.get((op, torch.uint8), 0) + calls
    assert fp8.by_dtype == expected, (plain.by_dtype, fp8.by_dtype)
    assert fp8.calls == expected_calls, (plain.calls, fp8.calls)


def parameters_now(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter this rank holds (a DTensor's local shard; not another pipeline stage's, left on the
    meta device), in its own dtype, for `assert_first_step_within_adam` (no collective: it may sit inside a byte
    count)."""
    copies = {}
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        assert isinstance(local, torch.Tensor)
        if local.is_meta:
            continue
        copies[name] = local.detach().clone()
    return copies


def assert_first_step_within_adam(
    start: dict[str, torch.Tensor],
    bf16: dict[str, torch.Tensor],
    fp8: dict[str, torch.Tensor],
    lr: float,
    fp8_gathered: bool = False,
) -> float:
    """Every parameter after the first AdamW step of an fp8 run against the bf16 run's, from the same `start`;
    returns the fraction of elements that moved in the same direction (sign of p1 - p0) in both runs.

    The bound, from torch.optim.AdamW's arithmetic at step 1 (bias-corrected: m_hat = g, v_hat = g**2):
    p1 = p0 * (1 - lr * wd) - lr * g / (|g| + eps). Both runs start from the same p0, so the decay term cancels and
    the runs' exact results differ by lr * |g_a / (|g_a| + eps) - g_b / (|g_b| + eps)| < 2 * lr whatever the fp8
    gradients are (`adam_step_tolerance` with an unbounded gradient difference). Each run's computed value is at
    most four roundings off its exact one (the decay, the update's division and product, the subtraction; the
    store into a bf16 parameter), each at most the unit roundoff u of the parameter's dtype (or of float32, finer)
    relative to |p| + lr; both runs' together: 4 * u * (|a| + |b| + 2 * lr) to first order.

    `fp8_gathered`: the fp8 run's values were captured after an fp8 parameter all-gather (ZeRO's and Gemini's
    fp8_communication), each rounded to nearest E4M3 under its message's amax scale: at most E4M3's unit roundoff
    relative to the exact value (u / (1 - u) of the rounded one), or half a subnormal step (amax * 2**-9 / 448 / 2,
    the message's amax at most the largest value this rank holds) below the normal range."""
    if set(start) != set(bf16) or set(bf16) != set(fp8):
        raise ValueError(f"parameter names differ: {sorted(set(start) ^ set(bf16) | set(bf16) ^ set(fp8))}")
    step = adam_step_tolerance(lr, ADAM_EPS, math.inf)  # 2 * lr
    same = total = 0
    largest = max((float(p.float().abs().max()) for p in fp8.values() if p.numel()), default=0.0) / (1 - E4M3_U)
    for name, before in start.items():
        a, b, p0 = fp8[name].float(), bf16[name].float(), before.float()
        if not a.shape == b.shape == p0.shape:
            raise ValueError(f"{name}: shapes differ: start {p0.shape}, bf16 {b.shape}, fp8 {a.shape}")
        rounding = 4 * unit_roundoff(bf16[name].dtype) * (a.abs() + b.abs() + 2 * lr)
        if fp8_gathered:
            rounding = rounding + E4M3_U / (1 - E4M3_U) * a.abs() + largest * E4M3_TINY / 2
        excess = (a - b).abs() - (step + rounding)
        if not bool((excess <= 0).all()):
            worst = int(excess.argmax())
            raise AssertionError(
                f"{name}: fp8 and bf16 differ by {excess.max().item()} beyond the bound at element {worst}: "
                f"start {p0.flatten()[worst].item()}, bf16 {b.flatten()[worst].item()}, fp8 {a.flatten()[worst].item()}"
            )
        same += int(((a - p0).sign() == (b - p0).sign()).sum())
        total += p0.numel()
    return same / total


@contextlib.contextmanager
def fp8_linear_rows() -> Iterator[list[int]]:
    """The rows of every cx_mesh.fp8.fp8_linear call made through the module attribute (cx-moe's expert matmuls)."""
    calls: list[int] = []
    original = cx_fp8.fp8_linear

    def spy(input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(input.shape[0])
        return original(input, weight, *args, **kwargs)

    cx_fp8.fp8_linear = spy
    try:
        yield calls
    finally:
        cx_fp8.fp8_linear = original
