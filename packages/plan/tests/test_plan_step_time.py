"""cx-plan's step-time model: FLOPs per token against torch's FLOP counter on the real GPT, the pipeline bubble
against the closed form of 1F1B, the collective volumes against the ring formulas, and the device / link tables."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cx_plan._candidate import Candidate
from cx_plan._devices import Link, Network, default_network, lookup_device, lookup_link, parse_memory
from cx_plan.step_time._comm_volume import Collective, step_collectives
from cx_plan.step_time._step_time import flops_per_token, predict_step_time
from cx_plan.trace._model_spec import ModelShape, ParameterCounts, shape_from_config
from cx_plugins.models import GPT, GPTConfig

_CONFIG = GPTConfig(vocab_size=256, max_positions=33, hidden_size=64, num_layers=2, num_heads=4)
_SEQ = 32
_IDEAL = Link("ideal", float("inf"), 0.0, "no communication cost")


@pytest.fixture(scope="module")
def gpt() -> ModelShape:
    return shape_from_config("gpt", _CONFIG)


def _moe_shape() -> ModelShape:
    """A Mixtral-like shape written out (no transformers import): 4 layers, 8 experts of 3 x 64 x 128, top-2."""
    per_expert = 3 * 64 * 128
    counts = ParameterCounts(
        total=4 * (20_000 + 8 * per_expert) + 2 * 64 * 1000,
        outer=2 * 64 * 1000,
        embeddings=2 * 64 * 1000,
        dense_per_layer=(20_000,) * 4,
        experts_per_layer=(8 * per_expert,) * 4,
        per_expert=per_expert,
        tied=False,
    )
    return ModelShape("moe", "mixtral", 1000, 64, 4, 4, 2, 16, 128, 8, 2, 64, counts, None)


def test_flops_per_token_match_torch_flop_counter_on_gpt(gpt: ModelShape) -> None:
    """FlopCounterMode counts every matmul of the forward and backward exactly (2mnk each); it does not count the
    CPU attention kernel, nor do matmuls touch the biases and norm weights that 6N includes. So the prediction must
    equal the counted FLOPs plus the attention term plus 6 x those vector parameters per token, exactly."""
    model = GPT(_CONFIG)
    batch = 2
    tokens = batch * _SEQ
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, _CONFIG.vocab_size, (batch, _SEQ))).float().sum().backward()
    vectors = sum(p.numel() for p in model.blocks.parameters() if p.dim() == 1)
    attention = 12 * _CONFIG.num_layers * _SEQ * _CONFIG.hidden_size
    predicted, in_layers = flops_per_token(gpt, _SEQ)
    assert predicted * tokens == counter.get_total_flops() + (attention + 6 * vectors) * tokens
    assert predicted - in_layers == 6 * _CONFIG.vocab_size * _CONFIG.hidden_size  # the (tied) LM head


def test_moe_flops_count_top_k_of_the_experts() -> None:
    shape = _moe_shape()
    per_token, _ = flops_per_token(shape, 64)
    active = 4 * 20_000 + 4 * 2 * shape.parameters.per_expert + 1000 * 64
    assert per_token == 6 * active + 12 * 4 * 64 * 64


def test_pipeline_bubble_is_the_1f1b_closed_form(gpt: ModelShape) -> None:
    """With free communication, 1F1B's makespan is (m + p - 1) micro-batch slots of one stage's forward+backward:
    the bubble is (p - 1) / m of the stage's compute. ZB-V fills most of it; interleaving shrinks it."""
    device = lookup_device("h100")
    ideal = Network(_IDEAL, _IDEAL, 8)
    p, m = 4, 8
    one = predict_step_time(Candidate("hybrid", pp=p, num_microbatches=m), gpt, _SEQ, device, ideal)
    assert one.bubble_s == pytest.approx(one.compute_s * (p - 1) / m, rel=1e-9)
    assert one.step_s == pytest.approx(one.compute_s + one.bubble_s + one.optimizer_s, rel=1e-9)
    zbv = predict_step_time(Candidate("hybrid", pp=p, num_microbatches=m, pp_style="zbv"), gpt, _SEQ, device, ideal)
    inter = predict_step_time(
        Candidate("hybrid", pp=p, num_microbatches=m, pp_style="interleaved"), gpt, _SEQ, device, ideal
    )
    assert zbv.bubble_s < inter.bubble_s < one.bubble_s
    recompute = predict_step_time(
        Candidate("hybrid", pp=p, num_microbatches=m, checkpoint_ratio=1.0), gpt, _SEQ, device, ideal
    )
    per_token, in_layers = flops_per_token(gpt, _SEQ)
    assert recompute.recompute_s == pytest.approx(one.compute_s * in_layers / 3 / per_token, rel=1e-9)


def test_collective_volumes_follow_the_ring_formulas(gpt: ModelShape) -> None:
    n, parameters = 4, gpt.parameters.dense

    def volume(candidate: Candidate) -> dict[str, float]:
        return {c.name: c.bytes for c in step_collectives(candidate, gpt, _SEQ)}

    ddp = volume(Candidate("torch_ddp", dp=n))
    assert ddp == {"dense gradient all-reduce": pytest.approx(2 * (n - 1) / n * parameters * 4)}
    zero2 = volume(Candidate("low_level_zero", dp=n, precision="bf16"))
    assert zero2["dense gradient reduce-scatter"] == pytest.approx((n - 1) / n * parameters * 2)
    assert zero2["dense weight all-gather"] == pytest.approx((n - 1) / n * parameters * 2)
    gemini = volume(Candidate("gemini", dp=n))  # ZeRO-3: gathers in the forward and again in the backward
    assert gemini["dense weight all-gather"] == pytest.approx(2 * zero2["dense weight all-gather"])
    fsdp = volume(Candidate("torch_fsdp", dp=n, precision="bf16"))  # bf16 gathers, fp32 gradient reduction
    assert fsdp["dense weight all-gather"] == pytest.approx(2 * zero2["dense weight all-gather"])
    assert fsdp["dense gradient reduce-scatter"] == pytest.approx(2 * zero2["dense gradient reduce-scatter"])
    tp = volume(Candidate("hybrid", tp=2, micro_batch_size=2, precision="fp32"))
    calls = 2 * _CONFIG.num_layers * 2 + 2  # two per layer each way, plus the vocabulary-parallel embedding
    ring = 2 * (2 - 1) / 2  # an all-reduce over 2 ranks sends its whole tensor once
    assert tp["tp activation all-reduce"] == pytest.approx(calls * 2 * _SEQ * _CONFIG.hidden_size * 4 * ring)
    # GeminiPlugin(tp_size=2): hybrid tp's activation all-reduces, and ZeRO-3 gathers of a tp rank's half over dp
    gemini_tp = volume(Candidate("gemini", dp=n, tp=2, micro_batch_size=2, precision="fp32"))
    assert gemini_tp["tp activation all-reduce"] == pytest.approx(tp["tp activation all-reduce"])
    assert gemini_tp["dense weight all-gather"] == pytest.approx(2 * (n - 1) / n * parameters / 2 * 4)


def test_moe_all_to_all_and_links() -> None:
    """Dispatch + combine of top_k copies per MoE layer, forward and backward; a group wider than a node takes the
    inter-node link, so the same dp on 16 H100s is slower per byte than on 8."""
    shape = _moe_shape()
    c = Candidate("moe_hybrid", dp=4, ep=4, micro_batch_size=2, precision="bf16")
    moved = {col.name: col.bytes for col in step_collectives(c, shape, 64)}
    copies = 2 * 64 * shape.top_k * shape.hidden_size * 2
    assert moved["expert dispatch/combine all-to-all"] == pytest.approx(4 * 4 * copies * 3 / 4)
    ddp = {col.name: col.bytes for col in step_collectives(Candidate("torch_ddp", dp=4), shape, 64)}
    assert ddp == {"dense gradient all-reduce": pytest.approx(2 * 3 / 4 * shape.parameters.total * 4)}  # experts too
    device = lookup_device("h100")
    inside = predict_step_time(Candidate("torch_ddp", dp=8), shape, 64, device)
    across = predict_step_time(Candidate("torch_ddp", dp=16), shape, 64, device)
    nvlink, infiniband = default_network(device).intra, default_network(device).inter
    assert inside.communication_s["dense gradient all-reduce"] < across.communication_s["dense gradient all-reduce"]
    assert nvlink.bandwidth / infiniband.bandwidth == 9  # 450 GB/s vs 50 GB/s per direction


def test_device_tables_and_clear_errors() -> None:
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("64GiB") == 64 * 2**30
    assert parse_memory("512 MiB") == 512 * 2**20
    assert parse_memory("1.5G") == 1_500_000_000
    for bad in ("eighty GB", "80 XB", "", "-3GB", "0GB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_memory(bad)
    h200 = lookup_device("H200")
    assert h200.memory_bytes == 143_771 * 2**20  # what an H200 reports, not the 141 GB of its datasheet
    assert h200.peak("bf16") == lookup_device("h100").peak("bf16") == 989e12
    assert lookup_device("a100").peak("bf16") == 312e12
    assert lookup_device("h100", memory_bytes=10**9).memory_bytes == 10**9
    with pytest.raises(ValueError, match="unknown device 'tpu'; known: a100, cpu, h100, h100_96gb, h200"):
        lookup_device("tpu")
    with pytest.raises(ValueError, match="unknown interconnect 'ethernet'"):
        lookup_link("ethernet")
    assert lookup_link("nvlink4", bandwidth=1e9).bandwidth == 1e9
    with pytest.raises(ValueError, match="achievable fraction"):
        predict_step_time(Candidate("torch_ddp"), _moe_shape(), 64, h200, efficiency=1.5)
    assert dataclasses.replace(h200, name="x").name == "x"


_A100_NET = default_network(lookup_device("a100"))  # NVLink 3 300 GB/s, HDR 25 GB/s per GPU, 8 per node


@pytest.mark.parametrize(
    ("candidate", "name", "per_node"),
    [
        (Candidate("torch_fsdp", dp=8), "dense weight all-gather", None),  # one node: NVLink
        (Candidate("torch_fsdp", dp=64), "dense weight all-gather", 8),  # 8 whole nodes
        (Candidate("torch_fsdp", dp=9), "dense weight all-gather", 1),  # ranks 0-7 | 8: the second node holds 1
        (Candidate("torch_fsdp", dp=12), "dense weight all-gather", 4),  # 0-7 | 8-11
        (Candidate("torch_fsdp", dp=20), "dense weight all-gather", 4),  # 0-7 | 8-15 | 16-19
        (Candidate("hybrid", dp=32, tp=8), "dense gradient all-reduce", 1),  # dp stride 8: one rank per node
        (Candidate("hybrid", dp=16, tp=2), "dense gradient all-reduce", 4),  # dp stride 2: 0, 2, 4, 6 | 8, ...
        (Candidate("hybrid", dp=3, tp=4), "dense gradient all-reduce", 1),  # dp {0, 4 | 8}: 2 and 1
        (Candidate("hybrid", dp=3, tp=4), "tp activation all-reduce", None),  # tp {0-3}, {4-7}, {8-11}: in a node
        (Candidate("hybrid", dp=3, tp=3), "tp activation all-reduce", 1),  # tp {6, 7 | 8} crosses: 2 and 1
        # dp x sp with pp in between (sp stride 1, pp 4, dp 8): {0-3, 8-11}: 4 per node (the span's 12 averaged 5)
        (Candidate("hybrid", dp=2, pp=2, sp=4, sp_mode="all_to_all"), "dense gradient all-reduce", 4),
    ],
    ids=["fsdp8", "fsdp64", "fsdp9", "fsdp12", "fsdp20", "dp32-tp8", "dp16-tp2", "dp3-tp4", "tp4-of-12", "tp3-of-9",
         "dp2-pp2-sp4"],
)  # fmt: skip
def test_ring_collectives_across_nodes_count_the_fewest_ranks_per_node(
    gpt: ModelShape, candidate: Candidate, name: str, per_node: int | None
) -> None:
    """A ring collective across nodes runs at the inter link times the group's ranks on the node holding fewest of
    them (NCCL spreads its rings over a node's NICs; the slowest node bounds the ring, the slowest group the step),
    at most the intra link; a group inside one node at the intra link. Hand-counted from the layouts' rank order
    (hybrid: dp, pp, tp, sp row-major)."""
    c = dataclasses.replace(candidate, precision="bf16")
    found = next(x for x in step_collectives(c, gpt, _SEQ) if x.name == name)
    assert found.ring
    expected = 300e9 if per_node is None else min(300e9, per_node * 25e9)
    assert _A100_NET.ring_bandwidth(found.axes, found.world) == expected
    step = predict_step_time(c, gpt, _SEQ, lookup_device("a100"), _A100_NET)
    latency = _A100_NET.link_for(found.span).latency
    assert step.communication_s[name] == pytest.approx(found.hops * latency + found.bytes / expected)


def test_ring_bandwidth_is_capped_by_the_intra_link_and_leaves_other_collectives() -> None:
    """The summed NICs never beat the intra link the ring also passes; all-to-all stays at one link's bandwidth."""
    assert default_network(lookup_device("h100")).ring_bandwidth(((128, 1),), 128) == 8 * 50e9  # below NVLink 4's
    fast = Network(lookup_link("nvlink3"), lookup_link("ib_ndr"), 8)
    assert fast.ring_bandwidth(((64, 1),), 64) == 300e9  # 8 x 50 capped at 300
    moe = Candidate("moe_hybrid", dp=16, ep=16, precision="bf16")
    kinds = {c.name: c.ring for c in step_collectives(moe, _moe_shape(), 64)}
    assert kinds["expert dispatch/combine all-to-all"] is False
    with pytest.raises(ValueError, match="needs its group's layout axes"):
        Collective("x", 4, 4, 1.0, 3, ring=True)


def test_device_rows_carry_their_achievable_fraction(gpt: ModelShape) -> None:
    """a100 and h100_96gb carry the fraction fitted to their published run, the others ACHIEVABLE_FRACTION; an
    explicit efficiency overrides the row's."""
    from cx_plan._devices import ACHIEVABLE_FRACTION

    assert lookup_device("h100").efficiency == lookup_device("cpu").efficiency == ACHIEVABLE_FRACTION
    c = Candidate("torch_ddp", precision="bf16")
    for name, fitted in (("a100", 0.60), ("h100_96gb", 0.40)):
        device = lookup_device(name)
        assert device.efficiency == fitted
        default = predict_step_time(c, gpt, _SEQ, device)
        assert default.compute_s == predict_step_time(c, gpt, _SEQ, device, efficiency=fitted).compute_s
        assert default.compute_s == pytest.approx(
            predict_step_time(c, gpt, _SEQ, device, efficiency=ACHIEVABLE_FRACTION).compute_s
            * ACHIEVABLE_FRACTION / fitted
        )  # fmt: skip
