"""fp8 in cx-moe (MoeFp8Options): the grouped experts' matmuls through cx_mesh.fp8.fp8_linear (use_fp8) and the
dispatch / combine all-to-alls through cx_mesh.fp8.all_to_all_single_fp8 (fp8_communication), on one process and
on 2 ranks (ep 2) with uneven batches and an expert nobody routes to.

fp8 numerics are cx_mesh's tests; here: the fp8 path really runs (fp8_linear calls, bytes on the wire), unused
experts still get zero gradients, and the results follow from the arithmetic (bounds below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import fp8 as cx_fp8
from cx_mesh.testing import count_collective_bytes, distributed
from cx_moe import (
    CapacityOptions,
    ExpertOptions,
    GroupedExperts,
    MoeFp8Options,
    MoeLayer,
    RouterOptions,
    convert_moe_to_fp8,
    grouped_linear,
)
from moe_test_helpers import force_routing, groups

U_E4M3 = 2.0**-4  # unit roundoff of E4M3 (3 mantissa bits)
HIDDEN, INTER, EXPERTS = 32, 32, 4


@contextlib.contextmanager
def fp8_linear_calls() -> Iterator[list[int]]:
    """Rows of every cx_mesh.fp8.fp8_linear call made inside (cx-moe calls it through the module attribute)."""
    rows: list[int] = []
    original = cx_fp8.fp8_linear

    def spy(input: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        rows.append(input.shape[0])
        return original(input, weight, *args, **kwargs)  # type: ignore[arg-type]

    cx_fp8.fp8_linear = spy
    try:
        yield rows
    finally:
        cx_fp8.fp8_linear = original


def _quantization_error(t: torch.Tensor) -> torch.Tensor:
    """Largest error of tensorwise E4M3 quantization per element: u relative for normal values, plus half the
    subnormal spacing (2^-10 of the scale amax / 448) for the tiny ones."""
    scale = t.abs().amax() / torch.finfo(cx_fp8.E4M3).max
    return U_E4M3 * t.abs() + 2.0**-10 * scale


def test_grouped_linear_in_fp8_within_the_quantization_bound_with_an_empty_expert() -> None:
    torch.manual_seed(0)
    counts = [5, 0, 7, 4]
    x = torch.randn(sum(counts), HIDDEN, requires_grad=True)
    weight = torch.randn(EXPERTS, INTER, HIDDEN, requires_grad=True)
    with fp8_linear_calls() as rows:
        out = grouped_linear(x, weight, counts, fp8=cx_fp8.Fp8Options())
    assert rows == [5, 7, 4], "one fp8 matmul per expert with rows; the empty expert needs none"
    out.sum().backward()
    assert weight.grad is not None
    assert torch.equal(weight.grad[1], torch.zeros_like(weight.grad[1]))
    # per row block: |x'w' - xw| <= (|x| + dx)(|w| + dw)^T - |x||w|^T with dx, dw the per-expert quantization errors
    for e, (xs, start) in enumerate(zip(torch.split(x.detach(), counts), [0, 5, 5, 12], strict=True)):
        if not counts[e]:
            continue
        w = weight.detach()[e]
        exact = xs.double() @ w.double().T
        ax, aw = xs.abs().double(), w.abs().double()
        bound = (ax + _quantization_error(xs).double()) @ (aw + _quantization_error(w).double()).T - ax @ aw.T
        error = (out.detach()[start : start + counts[e]].double() - exact).abs()
        assert bool((error <= bound + 1e-6 * exact.abs()).all()), f"expert {e}: fp8 error above the bound"


def test_fp8_skips_ineligible_and_excluded_experts_and_refuses_meaningless_fp8_communication() -> None:
    experts = GroupedExperts(2, 8, 8, fp8=cx_fp8.Fp8Options())  # 8 < 16: stays high precision
    with fp8_linear_calls() as rows:
        experts(torch.randn(6, 8), [3, 3])
    assert rows == []
    layer = MoeLayer(ExpertOptions(HIDDEN, INTER), RouterOptions(num_experts=EXPERTS, top_k=2))
    with pytest.raises(ValueError, match=r"fp8_communication=True.*no all-to-all to compress"):
        layer.set_fp8(MoeFp8Options(fp8_communication=True))
    with pytest.raises(ValueError, match=r"fp8_communication=True.*no all-to-all to compress"):
        convert_moe_to_fp8(nn.Sequential(layer), MoeFp8Options(fp8_communication=True))
    with pytest.raises(ValueError, match="has no MoeLayer or MoE block"):
        convert_moe_to_fp8(nn.Linear(32, 32), MoeFp8Options(use_fp8=True))
    # a MoeLayer's shared expert follows use_fp8 both ways; the router stays high precision
    shared = MoeLayer(ExpertOptions(HIDDEN, INTER, shared_intermediate_size=32), RouterOptions(EXPERTS, 2))
    shared.set_fp8(MoeFp8Options(use_fp8=True))
    assert shared.shared_expert is not None
    assert isinstance(shared.shared_expert.up_proj, cx_fp8.Fp8Linear)
    shared.set_fp8(MoeFp8Options())
    assert type(shared.shared_expert.up_proj) is nn.Linear
    assert shared.experts.fp8 is None
    # Fp8Options.exclude names layers whose experts keep high precision
    kept = MoeLayer(ExpertOptions(HIDDEN, INTER), RouterOptions(num_experts=EXPERTS, top_k=2))
    model = nn.ModuleDict({"moe": layer, "moe_skipped": kept})
    options = MoeFp8Options(use_fp8=True, matmul=cx_fp8.Fp8Options(exclude=("skipped",)))
    assert convert_moe_to_fp8(model, options) == ["moe", "moe_skipped"]
    assert layer.experts.fp8 == options.matmul
    assert kept.experts.fp8 is None


def test_hf_mixtral_experts_in_fp8_without_expert_parallelism() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2, use_cache=False,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    reference = model(input_ids=ids, labels=ids).loss.detach()
    names = convert_moe_to_fp8(model, MoeFp8Options(use_fp8=True))
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    with fp8_linear_calls() as rows:
        loss = model(input_ids=ids, labels=ids).loss
    assert 0 < len(rows) <= 2 * 2 * EXPERTS
    assert len(rows) % 2 == 0
    assert sum(rows) == 2 * 2 * ids.numel() * 2  # layers x projections x tokens x top_k: every assignment in fp8
    loss.backward()
    assert model.model.layers[0].mlp.experts.down_proj.grad is not None
    # the 3% for fp8 against high precision
    assert abs(float(loss.detach()) - float(reference)) <= 0.03 * float(reference)


def _fp8_layer(fp8: MoeFp8Options | None, ep: bool, capacity: CapacityOptions | None = None) -> MoeLayer:
    ep_group, moe_dp_group = groups(2) if ep else (None, None)
    torch.manual_seed(0)
    layer = MoeLayer(
        ExpertOptions(HIDDEN, INTER),
        RouterOptions(num_experts=EXPERTS, top_k=2),
        capacity=capacity,
        ep_group=ep_group,
        moe_dp_group=moe_dp_group,
        dtype=torch.bfloat16,
        fp8=fp8,
    )
    force_routing(layer.gate.weight, unused=(3,))  # expert 3 (ep rank 1's second) never receives a token
    return layer


def _batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return (torch.randn(6 + 5 * rank, HIDDEN, generator=g).abs() + 0.1).to(torch.bfloat16)  # uneven batches


def _run(layer: MoeLayer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Output, input gradient and all-to-all bytes of one forward and backward."""
    x = x.clone().requires_grad_(True)
    with count_collective_bytes() as moved:
        out = layer(x)
        out.float().pow(2).sum().backward()
    assert x.grad is not None
    return out.detach().float(), x.grad.float(), moved.by_op.get("all_to_all_single", 0)


@distributed(world_size=2)
def test_ep2_fp8_experts_and_all_to_all(rank: int, world_size: int) -> None:
    x = _batch(rank)
    # routing is the same in every run (the router is bf16 and never fp8): assignments per expert over all ranks
    probe = _fp8_layer(None, ep=True)
    counts = torch.bincount(probe.gate(x).indices.reshape(-1), minlength=EXPERTS)
    dist.all_reduce(counts)
    assert int(counts[3]) == 0
    assert bool((counts[:3] > 0).all())
    mine = counts[2 * rank : 2 * rank + 2].tolist()

    bf16_out, _bf16_grad, bf16_bytes = _run(_fp8_layer(None, ep=True), x)
    layer = _fp8_layer(MoeFp8Options(use_fp8=True, fp8_communication=True), ep=True)
    formats: list[torch.dtype] = []
    exchange = cx_fp8.all_to_all_single_fp8

    def recording(*args: Any, **kwargs: Any) -> Any:
        formats.append(kwargs.get("fp8_dtype", cx_fp8.E4M3))
        return exchange(*args, **kwargs)

    cx_fp8.all_to_all_single_fp8 = recording
    try:
        with fp8_linear_calls() as rows:
            out, grad, fp8_bytes = _run(layer, x)
    finally:
        cx_fp8.all_to_all_single_fp8 = exchange
    # rows forward in E4M3 (dispatch, combine), gradients back in E5M2 (combine's backward, then dispatch's)
    assert formats == [cx_fp8.E4M3, cx_fp8.E4M3, cx_fp8.E5M2, cx_fp8.E5M2]
    # fp8 matmuls: two per local expert with rows, on exactly its rows
    assert sorted(rows) == sorted([n for n in mine if n] * 2)
    # the unused expert's weights still join the graph: zero gradients, not None
    for weight in (layer.experts.gate_up_proj, layer.experts.down_proj):
        assert weight.grad is not None
        assert bool(torch.isfinite(weight.grad).all())
        if rank == 1:
            assert not bool(weight.grad[1].any())
    # bytes: the count exchange (EXPERTS int64) is exact; each of the 4 row exchanges (dispatch, combine, and their
    # backwards) sends half the bf16 bytes plus one float32 scale per destination rank
    counts_bytes = EXPERTS * 8
    assert fp8_bytes == counts_bytes + (bf16_bytes - counts_bytes) // 2 + 4 * world_size * 4
    # six E4M3 roundings lie on the forward path (dispatch, the two operands of each of the two matmuls, combine),
    # each at most u = 2^-4 relative: their first-order sum bounds the output's relative error in norm
    assert float((out - bf16_out).norm() / bf16_out.norm()) <= 6 * U_E4M3
    assert bool(torch.isfinite(grad).all())

    # use_fp8 alone: ep 2 computes exactly what the unsplit fp8 layer computes on both ranks' tokens (every expert
    # sees the same rows in the same order, so the same scales and the same fp8 products)
    split_out, split_grad, _ = _run(_fp8_layer(MoeFp8Options(use_fp8=True), ep=True), x)
    both = torch.cat([_batch(0), _batch(1)])
    whole_out, whole_grad, _ = _run(_fp8_layer(MoeFp8Options(use_fp8=True), ep=False), both)
    start = 0 if rank == 0 else _batch(0).shape[0]
    torch.testing.assert_close(split_out, whole_out[start : start + x.shape[0]], rtol=0, atol=0)
    torch.testing.assert_close(split_grad, whole_grad[start : start + x.shape[0]], rtol=0, atol=0)


@distributed(world_size=2)
def test_ep2_fp8_with_an_empty_rank_and_padded_capacity(rank: int, world_size: int) -> None:
    both = MoeFp8Options(use_fp8=True, fp8_communication=True)
    # rank 1 brings no tokens: its chunks are empty (a scale still travels per destination), nothing hangs
    x = _batch(rank)[: 0 if rank == 1 else None]
    layer = _fp8_layer(both, ep=True)
    out, grad, _ = _run(layer, x)
    assert out.shape == x.shape
    assert bool(torch.isfinite(out).all())
    assert bool(torch.isfinite(grad).all())
    for weight in (layer.experts.gate_up_proj, layer.experts.down_proj):
        assert weight.grad is not None
        assert bool(torch.isfinite(weight.grad).all())
    # padded capacity: fixed equal splits, no count exchange; fp8 moves exactly half the bytes plus the scales of
    # the 4 row exchanges (one per destination rank each)
    padded = CapacityOptions(1.0, pad_to_capacity=True)
    x = _batch(0)  # the same token count on every rank, as padding requires
    bf16_out, _, bf16_bytes = _run(_fp8_layer(None, ep=True, capacity=padded), x)
    out, _, fp8_bytes = _run(_fp8_layer(both, ep=True, capacity=padded), x)
    assert fp8_bytes == bf16_bytes // 2 + 4 * 4 * world_size
    assert float((out - bf16_out).norm() / bf16_out.norm()) <= 6 * U_E4M3  # as in the dropless test above
