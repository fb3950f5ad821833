"""cx-plan under `--optimizer muon` (cx-zero's MuonWithAdamW, as cx-train runs it): the optimizer states counted
from the parameter shapes (one fp32 momentum per hidden-matrix element, AdamW's two fp32 moments on the rest), the
whole-matrix owners under ZeRO (cx-zero's own assignment), the gather / scatter and Newton-Schulz in the step time,
the layouts cx refuses left out, and the printed cx-train command carrying the flag. The measured check is in
test_plan_memory (DDP, ZeRO-1, FSDP and hybrid ZeRO-1 at tp 2 under Muon, within its 10 %)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from cx_plan import Candidate, Device, ModelShape, Optimizer, load_model_shape, lookup_device, predict_step_time
from cx_plan._cli import main
from cx_plan._enumerate import SearchSpace, enumerate_candidates, optimizer_skips
from cx_plan._report import train_command
from cx_plan.memory._memory import predict_memory
from cx_plan.step_time._comm_volume import step_collectives
from cx_plan.step_time._step_time import HOST_FLOPS, _optimizer_seconds
from cx_plan.trace._model_spec import build_model, shape_from_config
from cx_plan.trace._muon_split import muon_split, ns_flops, stepped_load
from cx_plugins.models import GPTConfig
from cx_zero import assign_owners, muon_param_groups

HIDDEN, LAYERS, SEQ = 64, 2, 32
_GPT = ["--model", "gpt", "--hidden-size", "32", "--num-layers", "2", "--seq-len", "32", "--device", "cpu"]


@dataclass(frozen=True)
class _Fits:
    fits: bool = True
    peak_bytes: int = 1
    reason: str = ""


def _fits(shape: ModelShape, seq_len: int, device: Device) -> Callable[[Candidate], _Fits]:
    """Every candidate fits (the command's tests need no trace)."""
    return lambda candidate: _Fits()


def _llama_hidden_matrices() -> tuple[list[tuple[int, ...]], list[bool]]:
    """Each trained parameter's shape and whether it is a hidden matrix, by Muon's rule read off the names: 2-D,
    neither the token embedding nor the (untied) output head."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    with torch.device("meta"):
        model = build_model(shape)
    named = list(model.named_parameters())
    shapes = [tuple(p.shape) for _, p in named]
    hidden = [p.ndim == 2 and "embed_tokens" not in n and "lm_head" not in n for n, p in named]
    return shapes, hidden


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def test_muon_holds_four_bytes_less_per_hidden_matrix_element() -> None:
    """DDP replicates the states: AdamW 8 bytes per element; Muon 4 per hidden-matrix element, 8 per other one, so
    the difference is exactly 4 x the hidden matrices' elements (llama: embeddings and the untied head stay AdamW)."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    shapes, hidden = _llama_hidden_matrices()
    matrices = sum(_numel(s) for s, h in zip(shapes, hidden, strict=True) if h)
    total = sum(_numel(s) for s in shapes)
    assert 0 < matrices < total
    assert muon_split(shape).muon_elements == matrices
    adamw = predict_memory(shape, Candidate("torch_ddp", dp=2, precision="fp32"), SEQ)
    muon = predict_memory(shape, Candidate("torch_ddp", dp=2, precision="fp32", optimizer=Optimizer.MUON), SEQ)
    assert adamw.optimizer_states == 8 * total
    assert muon.optimizer_states == 8 * total - 4 * matrices
    assert adamw.peak - muon.peak == 4 * matrices  # the step's workspace stays under the backward's peak here


def test_muon_under_zero_holds_the_busiest_owners_whole_matrices_and_a_shard_of_adamw() -> None:
    """ZeRO-1 over dp 2: each hidden matrix has one owner (cx-zero's `assign_owners` over the matrices alone), which
    keeps its whole fp32 master and momentum; the AdamW parameters (embeddings, norms, head) step on the flat shards
    as under a plain AdamW, each rank holding its padded half of their two moments and no whole master."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    shapes, hidden = _llama_hidden_matrices()
    matrices = [s for s, h in zip(shapes, hidden, strict=True) if h]
    owners = assign_owners(matrices, 2)
    per_rank = []
    for rank in range(2):
        elements = sum(_numel(s) for s, o in zip(matrices, owners, strict=True) if o == rank)
        per_rank.append((4 * elements + 8 * elements, 4 * elements, elements))
    _, momenta, elements = max(per_rank)
    adamw_shard = sum(-(-_numel(s) // 2) for s, h in zip(shapes, hidden, strict=True) if not h)
    total = sum(_numel(s) for s in shapes)
    assert 0 < adamw_shard < total // 2
    zero = Candidate("low_level_zero", dp=2, zero_stage=1, precision="fp32")
    adamw = predict_memory(shape, zero, SEQ)
    muon = predict_memory(shape, Candidate("low_level_zero", dp=2, zero_stage=1, precision="fp32",
                                           optimizer=Optimizer.MUON), SEQ)  # fmt: skip
    assert adamw.optimizer_states == 8 * total // 2
    assert muon.optimizer_states == momenta + 8 * adamw_shard
    assert muon.master_weights - adamw.master_weights == 4 * elements  # whole matrices beside the master shards


def test_muon_under_gemini_still_holds_whole_adamw_states_on_owners() -> None:
    """Gemini steps every parameter of MuonWithAdamW whole on an owner (its chunk path is separate): the busiest
    owner of all parameters, the AdamW ones included."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    shapes, hidden = _llama_hidden_matrices()
    owners = assign_owners(shapes, 2)
    per_rank = []
    for rank in range(2):
        mine = [(s, h) for s, h, o in zip(shapes, hidden, owners, strict=True) if o == rank]
        states = sum(_numel(s) * (4 if h else 8) for s, h in mine)
        per_rank.append((states + 8 * sum(_numel(s) for s, _ in mine), states))
    gemini = Candidate("gemini", dp=2, precision="bf16", optimizer=Optimizer.MUON)
    assert predict_memory(shape, gemini, SEQ).optimizer_states == max(per_rank)[1]


@pytest.mark.parametrize("ep", [1, 2])
def test_muon_under_moe_hybrid_tp_keeps_every_expert_state_where_the_experts_are(ep: int) -> None:
    """moe_hybrid tp 2 at ZeRO 0: the routed experts are replicated over tp, so each rank keeps the states of all its
    ep share of them (no owner, no whole master); the other parameters have owners over tp (`_tp_whole`)."""
    shape = load_model_shape("mixtral", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    with torch.device("meta"):
        model = build_model(shape)
    muon = {id(p): bool(g["use_muon"]) for g in muon_param_groups(model) for p in g["params"]}
    named = [(n, p) for n, p in model.named_parameters() if id(p) in muon]
    experts = [p for n, p in named if ".experts." in n]
    rest = [p for n, p in named if ".experts." not in n]
    assert experts
    assert rest

    def states(p: torch.Tensor) -> int:
        return p.numel() * (4 if muon[id(p)] else 8)

    owners = assign_owners([tuple(p.shape) for p in rest], 2)
    per_rank = [[p for p, o in zip(rest, owners, strict=True) if o == rank] for rank in range(2)]
    busiest = max(per_rank, key=lambda ps: sum(states(p) for p in ps))
    adamw = predict_memory(shape, Candidate("moe_hybrid", dp=ep, tp=2, ep=ep, precision="fp32"), SEQ)
    predicted = predict_memory(shape, Candidate("moe_hybrid", dp=ep, tp=2, ep=ep, precision="fp32",
                                                optimizer=Optimizer.MUON), SEQ)  # fmt: skip
    assert predicted.optimizer_states == sum(states(p) for p in busiest) + sum(states(p) for p in experts) // ep
    assert predicted.master_weights - adamw.master_weights == 4 * sum(p.numel() for p in busiest)
    # the step: only the rest is gathered over tp (fp32, half of it from the other rank); the rank steps all experts
    c = Candidate("moe_hybrid", dp=ep, tp=2, ep=ep, precision="fp32", optimizer=Optimizer.MUON)
    sent = {col.name: col.bytes for col in step_collectives(c, shape, SEQ)}
    assert sent["muon gradient gather"] == sent["muon weight scatter"] == 0.5 * 4 * shape.parameters.dense
    load = stepped_load(c, shape)
    assert load.state_bytes == sum(states(p) for p in busiest) + sum(states(p) for p in experts) // ep
    assert predict_step_time(c, shape, SEQ, lookup_device("h100")).step_s > 0


def test_muon_under_fsdp_keeps_every_state_on_row_shards_and_moves_bf16_matrices() -> None:
    """TorchFSDPPlugin (ShardedMuon): 1/dp of every Muon momentum and AdamW moment, no whole master; the Muon
    matrices' updates gathered to owners and scattered back in bf16; Newton-Schulz of the busiest owner's matrices."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    split = muon_split(shape)
    c = Candidate("torch_fsdp", dp=2, precision="fp32", optimizer=Optimizer.MUON)
    adamw = predict_memory(shape, Candidate("torch_fsdp", dp=2, precision="fp32"), SEQ)
    muon = predict_memory(shape, c, SEQ)
    assert muon.optimizer_states == split.state_bytes // 2
    assert muon.master_weights == adamw.master_weights == 0
    sent = {col.name: col.bytes for col in step_collectives(c, shape, SEQ)}
    assert sent["muon gradient gather"] == sent["muon weight scatter"] == pytest.approx(0.5 * 2 * split.muon_elements)
    matrices = [s for s, m in zip(split.shapes, split.muon, strict=True) if m]
    owners = assign_owners(matrices, 2)
    busiest = max(sum(ns_flops(s) for s, o in zip(matrices, owners, strict=True) if o == r) for r in range(2))
    assert stepped_load(c, shape).ns_flops == busiest
    assert predict_step_time(c, shape, SEQ, lookup_device("h100")).step_s > 0


def _tp2_zero_owners(shape: ModelShape) -> tuple[list[int], list[int], int]:
    """By hand, at dp 2 x tp 2 with ZeRO owners: the Muon matrices' element counts, the busiest dp owner's matrices
    (indices) and the elements of the busiest tp owner's whole matrices among them."""
    split = muon_split(shape)
    matrices = [s for s, m in zip(split.shapes, split.muon, strict=True) if m]
    numel = [s[0] * s[1] for s in matrices]
    dp_owner = assign_owners(matrices, 2)
    best = max(range(2), key=lambda r: sum(n for n, o in zip(numel, dp_owner, strict=True) if o == r))
    owned = [i for i, o in enumerate(dp_owner) if o == best]
    tp_owner = assign_owners([matrices[i] for i in owned], 2)
    whole = max(sum(numel[i] for i, o in zip(owned, tp_owner, strict=True) if o == t) for t in range(2))
    return numel, owned, whole


def test_muon_under_hybrid_zero_tp_holds_dp_whole_slices_and_the_tp_owners_matrices() -> None:
    """HybridParallelPlugin ZeRO 1 at tp 2 (ZeroTensorParallelWhole): the busiest dp owner holds its matrices' tp
    slices whole (fp32), and the busiest tp owner at that dp coordinate their whole masters and momenta; ZeRO moves
    the slices over dp, then the tp group moves the dp owner's share over tp."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    c = Candidate("hybrid", dp=2, tp=2, zero_stage=1, precision="fp32", optimizer=Optimizer.MUON)
    split, (numel, owned, whole) = muon_split(shape), _tp2_zero_owners(shape)
    load = stepped_load(c, shape)
    assert load.muon_elements == load.elements == whole
    adamw = predict_memory(shape, Candidate("hybrid", dp=2, tp=2, zero_stage=1, precision="fp32"), SEQ)
    muon = predict_memory(shape, c, SEQ)
    assert muon.master_weights - adamw.master_weights == 4 * (sum(numel[i] for i in owned) // 2 + whole)
    sent = {col.name: col.bytes for col in step_collectives(c, shape, SEQ)}
    assert sent["muon gradient gather"] == pytest.approx(0.5 * 4 * split.muon_elements / 2)  # tp slices over dp
    assert sent["muon tp gradient gather"] == pytest.approx(0.5 * 4 * split.muon_elements / 2)  # half of them over tp
    assert predict_step_time(c, shape, SEQ, lookup_device("h100")).step_s > 0


def test_newton_schulz_flops_and_the_gather_scatter_are_in_the_step() -> None:
    # 5 iterations of X X^T (2 m^2 n), A @ A (2 m^3), B @ X (2 m^2 n) on the 3 x 5 matrix (m = 3), transposed alike
    assert ns_flops((3, 5)) == ns_flops((5, 3)) == 5 * (4 * 9 * 5 + 2 * 27)
    assert ns_flops((4, 3, 5)) == 4 * ns_flops((3, 5))
    assert ns_flops((7,)) == 0
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    device = lookup_device("h100")
    zero = Candidate("low_level_zero", dp=2, zero_stage=1, precision="bf16")
    adamw = predict_step_time(zero, shape, SEQ, device)
    muon = predict_step_time(Candidate("low_level_zero", dp=2, zero_stage=1, precision="bf16",
                                       optimizer=Optimizer.MUON), shape, SEQ, device)  # fmt: skip
    assert set(muon.communication_s) - set(adamw.communication_s) == {"muon gradient gather", "muon weight scatter"}
    # only the hidden matrices travel to owners under ZeRO (the AdamW parameters step on the shards)
    split = muon_split(shape)
    zero_muon = Candidate("low_level_zero", dp=2, zero_stage=1, precision="bf16", optimizer=Optimizer.MUON)
    gemini = Candidate("gemini", dp=2, precision="bf16", optimizer=Optimizer.MUON)
    (scatter,) = [x.bytes for x in step_collectives(zero_muon, shape, SEQ) if x.name == "muon weight scatter"]
    (everything,) = [x.bytes for x in step_collectives(gemini, shape, SEQ) if x.name == "muon weight scatter"]
    assert scatter == pytest.approx(everything * split.muon_elements / split.total)
    assert muon.step_s > adamw.step_s
    ddp = predict_step_time(Candidate("torch_ddp", dp=2, precision="bf16", optimizer=Optimizer.MUON), shape, SEQ,
                            device)  # fmt: skip
    assert not any(name.startswith("muon") for name in ddp.communication_s)  # every rank steps every matrix


def test_muon_layouts_cx_takes_are_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    shape = load_model_shape("mixtral", hidden_size=64, num_layers=2, seq_len=SEQ)
    space = SearchSpace(global_batch=8, optimizer=Optimizer.MUON, max_tp=2)
    found = enumerate_candidates(shape, 4, SEQ, space)
    assert found
    assert all(c.optimizer is Optimizer.MUON for c in found)
    assert [c for c in found if c.plugin == "torch_fsdp"]  # row shards, Newton-Schulz at owners
    assert [c for c in found if c.plugin == "hybrid" and c.tp > 1 and c.stage >= 1]  # dp owners, then tp owners
    moe_tp_zero = [c for c in found if c.plugin == "moe_hybrid" and c.tp > 1 and c.stage >= 1]
    assert moe_tp_zero  # dp (or moe_dp) owners, then tp owners, as hybrid
    assert [c for c in moe_tp_zero if c.pp > 1]  # each pp stage's tp group gathers its own slices
    assert [c for c in moe_tp_zero if c.sp_mode is not None]  # sequence parallelism changes only ZeRO's groups
    assert [c for c in found if c.plugin == "hybrid" and c.tp > 1]  # tp at ZeRO 0 steps whole matrices
    Candidate("moe_hybrid", tp=2, dp=2, ep=2, zero_stage=1, optimizer=Optimizer.MUON)
    Candidate("moe_hybrid", tp=2, pp=2, dp=1, zero_stage=1, num_microbatches=2, optimizer=Optimizer.MUON)
    Candidate("moe_hybrid", tp=2, dp=2, zero_stage=1, cpu_offload=True, optimizer=Optimizer.MUON)
    assert main([*_GPT, "--world", "2", "--optimizer", "muon", "--top", "1", "--quiet"], _fits) == 0
    out = capsys.readouterr().out
    skipped = [line for line in out.splitlines() if "not considered under --optimizer muon" in line]
    assert len(skipped) == 1  # the only layout left out: Gemini at tp > 1 (not modelled)
    assert "gemini at tp > 1" in skipped[0]
    best = next(line for line in out.splitlines() if line.strip().startswith("cx-train "))
    assert best.endswith("--optimizer muon")
    assert main([*_GPT, "--world", "2", "--optimizer", "muon", "--optimizer-states-dtype", "bf16"]) == 2
    assert "muon keeps fp32 states" in capsys.readouterr().err


def test_json_plan_candidates_round_trip_with_the_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [*_GPT, "--world", "2", "--optimizer", "muon", "--plugins", "low_level_zero", "--json", "--quiet"]
    assert main(flags, _fits) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    for row in rows:
        candidate = Candidate(**row["candidate"])
        assert candidate.optimizer is Optimizer.MUON
        assert row["label"].endswith(" muon")
        assert train_command(candidate, "gpt", 32).endswith("--optimizer muon")


def test_muon_with_cpu_offload_at_tp_is_a_candidate_as_the_plugin_takes_it() -> None:
    """HybridParallelPlugin steps a whole-tensor optimizer with cpu_offload at tp > 1 (CPU masters, the tp collectives
    on the device): the planner's candidate takes it too."""
    assert Candidate("hybrid", dp=2, tp=2, zero_stage=1, cpu_offload=True, optimizer=Optimizer.MUON).cpu_offload
    assert Candidate("hybrid", dp=2, tp=2, zero_stage=1, cpu_offload=True).cpu_offload  # AdamW: taken
    assert Candidate("hybrid", dp=2, zero_stage=1, cpu_offload=True, optimizer=Optimizer.MUON).cpu_offload  # tp 1


def test_gemini_at_tp_takes_muon_and_the_plan_leaves_it_out() -> None:
    """GeminiPlugin steps Muon at tp_size > 1 with its optimizer data on the device or on the CPU, so the candidate
    takes every placement; the planner enumerates Gemini at tp > 1 under AdamW only (its Muon owners over dp and tp
    are not modelled) and says so once."""
    assert Candidate("gemini", dp=2, tp=2, optimizer=Optimizer.MUON).muon
    for fields in (dict(placement_policy="auto"), dict(offload_optim_frac=1.0)):
        assert Candidate("gemini", dp=2, tp=2, optimizer=Optimizer.MUON, **fields).muon
        assert Candidate("gemini", dp=2, tp=2, **fields).tp == 2  # AdamW takes CPU optimizer data at tp > 1 too
    space = SearchSpace(global_batch=8, optimizer=Optimizer.MUON, max_tp=2)
    shape = load_model_shape("gpt", hidden_size=64, num_layers=2, seq_len=SEQ)
    gemini = [c for c in enumerate_candidates(shape, 4, SEQ, space) if c.plugin == "gemini"]
    assert gemini
    assert all(c.tp == 1 for c in gemini)
    assert any("gemini at tp > 1" in line for line in optimizer_skips(space, shape, 4))
    adamw = enumerate_candidates(shape, 4, SEQ, SearchSpace(global_batch=8, max_tp=2))
    assert {c.tp for c in adamw if c.plugin == "gemini"} == {1, 2}


def test_the_gemini_tp_skip_is_said_only_where_a_gemini_tp_layout_exists() -> None:
    """`optimizer_skips` names Gemini at tp > 1 only where AdamW would have enumerated such a layout: not on one rank,
    nor where tp divides no head count (3 heads, tp 2), nor under --max-tp 1."""
    shape = load_model_shape("gpt", hidden_size=64, num_layers=2, seq_len=SEQ)
    muon = SearchSpace(global_batch=8, optimizer=Optimizer.MUON, max_tp=2)
    assert optimizer_skips(muon, shape, 4)
    assert optimizer_skips(muon, shape, 1) == ()
    assert optimizer_skips(SearchSpace(global_batch=8, optimizer=Optimizer.MUON, max_tp=1), shape, 4) == ()
    odd = shape_from_config("gpt", GPTConfig(vocab_size=64, max_positions=SEQ + 1, hidden_size=48, num_layers=2,
                                             num_heads=3))  # fmt: skip
    assert not [c for c in enumerate_candidates(odd, 4, SEQ, SearchSpace(global_batch=8, max_tp=2)) if c.tp > 1]
    assert optimizer_skips(muon, odd, 4) == ()


def test_newton_schulz_runs_on_the_host_where_the_whole_masters_are() -> None:
    """cpu_offload (hybrid ZeRO 1 at tp 2) and Gemini with CPU optimizer data keep the owners' whole masters on the
    CPU, so Newton-Schulz runs there, at HOST_FLOPS instead of the GPU's bf16 rate, and the gradients gathered to
    the owners are received in host memory, not on the device."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    device = lookup_device("h100")
    gpu_rate = device.peak("bf16") * device.efficiency
    # Gemini's auto placement moves no optimizer bytes in the streaming term: the two steps differ by the NS rate only
    static = Candidate("gemini", dp=2, precision="bf16", optimizer=Optimizer.MUON)
    auto = Candidate("gemini", dp=2, precision="bf16", placement_policy="auto", optimizer=Optimizer.MUON)
    flops = stepped_load(static, shape).ns_flops
    assert flops > 0
    slower = predict_step_time(auto, shape, SEQ, device).step_s - predict_step_time(static, shape, SEQ, device).step_s
    assert slower == pytest.approx(flops / HOST_FLOPS - flops / gpu_rate, rel=1e-9)
    on_cpu = predict_step_time(auto, shape, SEQ, lookup_device("cpu"))  # the device is the host: its own rate
    cpu = lookup_device("cpu")
    assert on_cpu.step_s == pytest.approx(predict_step_time(static, shape, SEQ, cpu).step_s, rel=1e-9)
    # cpu_offload: the streaming term moves to the host too; Newton-Schulz adds the host's time on top of it
    on_gpu = Candidate("hybrid", dp=2, tp=2, zero_stage=1, precision="fp32", optimizer=Optimizer.MUON)
    offloaded = Candidate("hybrid", dp=2, tp=2, zero_stage=1, precision="fp32", cpu_offload=True,
                          optimizer=Optimizer.MUON)  # fmt: skip
    flops = stepped_load(offloaded, shape).ns_flops
    for c, rate in ((on_gpu, gpu_rate), (offloaded, HOST_FLOPS)):
        predicted = predict_step_time(c, shape, SEQ, device).optimizer_s
        assert predicted == pytest.approx(_optimizer_seconds(c, shape, device) + flops / rate, rel=1e-9)
    # memory: the whole masters, their state and the step's gathered wholes (2 x 4 bytes per whole element the
    # owner receives: the dp-whole tp slices and the tp owner's matrices) are all on the host
    numel, owned, whole = _tp2_zero_owners(shape)
    gathered = 2 * 4 * (sum(numel[i] for i in owned) // 2 + whole)
    device_side, host_side = predict_memory(shape, on_gpu, SEQ), predict_memory(shape, offloaded, SEQ)
    assert host_side.cpu_offloaded == device_side.optimizer_states + device_side.master_weights + gathered
    assert host_side.optimizer_states == host_side.master_weights == 0
    # the device's last instant is ZeRO 1's end of the backward (weights, their gradients, the packed bucket), not
    # the step's: the step leaves only the weights on the device
    assert host_side.end_of_backward == 3 * host_side.parameters
    assert device_side.end_of_backward >= device_side.parameters + gathered


def test_gemini_at_tp_moves_tp_slices_over_dp_then_the_owners_share_over_tp() -> None:
    """cx-train --plan of Gemini at tp 2 under Muon (`_tp_whole`): each rank gathers its tp slices (1/tp of the
    model) to dp owners, master beside gradient, and each dp owner's share goes over tp, masters regathered too."""
    shape = load_model_shape("llama", hidden_size=HIDDEN, num_layers=LAYERS, seq_len=SEQ)
    c = Candidate("gemini", dp=2, tp=2, precision="bf16", optimizer=Optimizer.MUON)
    sent = {col.name: col.bytes for col in step_collectives(c, shape, SEQ)}
    whole = 4 * shape.parameters.total  # fp32, every parameter has an owner under Gemini
    assert sent["muon gradient gather"] == pytest.approx(2 * 0.5 * whole / 2)  # (dp - 1) / dp of a tp half, x2
    assert sent["muon weight scatter"] == pytest.approx(0.5 * whole / 2)
    assert sent["muon tp gradient gather"] == pytest.approx(2 * 0.5 * whole / 2)  # (tp - 1) / tp of a dp half, x2
    assert sent["muon tp weight scatter"] == pytest.approx(0.5 * whole / 2)
