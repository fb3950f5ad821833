"""What the fp8 plugin tests share: a tiny HF Llama (hidden 32, 2 layers, every projection's dims multiples of 16)
and four fixed global batches cycled over the steps, so the model can learn them and the loss really falls (DDP,
FSDP); the exact bytes fp8_communication sends against the same run without it (hybrid, ZeRO, Gemini, MoE)."""

from __future__ import annotations

import torch
from torch import nn

from cx_mesh.testing import CollectiveBytes

VOCAB, PER_RANK, LENGTH, BATCHES = 64, 2, 16, 4
SCALE_BYTES = 4  # one float32 scale per fp8 message
_GATHERS = ("all_gather_single", "all_gather_into_tensor", "all_gather")
_REDUCE_SCATTERS = ("all_to_all_single", "reduce_scatter_single", "reduce_scatter_tensor")  # gloo: an all-to-all


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
