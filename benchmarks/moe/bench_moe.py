"""cx expert parallelism vs replicated experts vs transformers' own expert parallelism, 2 processes, CPU, gloo.

Run: `OMP_NUM_THREADS=1 .nox/tests/bin/python benchmarks/moe/bench_moe.py` (about two minutes on 2 cores;
`CX_BENCH_SMOKE=1` for a seconds-long check that the script works).

Part 1, one MoE layer (Mixtral's block: hidden 256, 8 experts of intermediate 1024, top-2, 2048 tokens per rank,
fp32), forward + backward + gradient reduction:
- replicated: every rank holds all experts (plain data parallelism): all gradients averaged with one flat
  all-reduce;
- cx ep2: `expert_parallelize_hf` on the same block (experts split over the 2 ranks, all-to-all dispatch), dense
  gradients (the router) averaged with one flat all-reduce, expert gradients not reduced (moe-dp size 1);
- transformers ep2: `transformers.distributed.expert_parallel.apply_expert_parallelism` with the model's own
  `base_model_ep_plan` styles (`grouped_gemm` + `ep_dispatch_experts`, AllToAllEP), dense gradients reduced the same
  way.
Part 2, a tiny Mixtral (2 layers, hidden 256, 8 experts of 1024, vocab 1024, seq 128, batch 8 per rank) training
step (forward with the aux loss, backward, reduction, AdamW) with the same three systems. The systems take turns
step by step in one pair of processes, so machine noise hits all alike; medians are reported. Part 3 splits one cx
layer step into router, dispatch (count exchange + all-to-all), grouped matmul, combine (all-to-all back + weighted
sum) and backward.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import spawn
from cx_moe import combine, dispatch, expert_parallelize_hf, is_moe_tensor

HIDDEN, INTER, EXPERTS, TOKENS, LAYERS, VOCAB, SEQ, BATCH = 256, 1024, 8, 2048, 2, 1024, 128, 8
WARMUP, STEPS = 2, int(os.environ.get("CX_BENCH_STEPS", 10))
if os.environ.get("CX_BENCH_SMOKE"):
    HIDDEN, INTER, TOKENS, VOCAB, SEQ, BATCH, STEPS = 32, 64, 64, 64, 16, 2, 2

Step = Callable[[int], None]


def _config() -> Any:
    import transformers

    return transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
    )


def _reduce(params: list[nn.Parameter]) -> None:
    """Average the given gradients over the world with one flat all-reduce (what DDP does, minus its buckets)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _is_expert(name: str, param: torch.Tensor) -> bool:
    return is_moe_tensor(param) or ".experts." in f".{name}"


def _hf_ep(model: nn.Module, prefix: str) -> None:
    """transformers' own EP on `model` (the names under `prefix` are its MoE blocks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "tp"))
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "MixtralSparseMoeBlock":
            base = f"{name}." if name else ""
            plan[f"{base}experts.gate_up_proj"] = "grouped_gemm"
            plan[f"{base}experts.down_proj"] = "grouped_gemm"
            plan[f"{base}experts"] = "ep_dispatch_experts"
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], plan)


def _systems(kind: str, rank: int) -> dict[str, tuple[Step, nn.Module]]:
    import transformers

    config = _config()
    systems: dict[str, tuple[Step, nn.Module]] = {}
    for system in ("replicated", "cx ep2", "transformers ep2"):
        torch.manual_seed(0)
        if kind == "layer":
            model: nn.Module = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
            for p in model.parameters():
                nn.init.normal_(p, std=0.02)
            config._experts_implementation = "grouped_mm"  # what a whole model gets by default
        else:
            model = transformers.MixtralForCausalLM(config)
        if system == "cx ep2":
            expert_parallelize_hf(model, dist.group.WORLD)  # type: ignore[arg-type]
        elif system == "transformers ep2":
            _hf_ep(model, "")
        reduced = [p for n, p in model.named_parameters() if system == "replicated" or not _is_expert(n, p)]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if kind == "model" else None
        systems[system] = (_make_step(kind, model, reduced, optimizer, rank), model)
    return systems


def _make_step(
    kind: str, model: nn.Module, reduced: list[nn.Parameter], optimizer: torch.optim.Optimizer | None, rank: int
) -> Step:
    def step(i: int) -> None:
        g = torch.Generator().manual_seed(1000 * i + rank)
        if kind == "layer":
            x = torch.randn(1, TOKENS, HIDDEN, generator=g)
            out = model(x)
            (out * torch.randn(out.shape, generator=g)).sum().backward()
        else:
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
        _reduce(reduced)
        if optimizer is not None:
            optimizer.step()
        for p in model.parameters():
            p.grad = None

    return step


def _expert_bytes(model: nn.Module) -> int:
    total = 0
    for name, p in model.named_parameters():
        if _is_expert(name, p):
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.numel() * local.element_size()
    return total


def _time(systems: dict[str, tuple[Step, nn.Module]]) -> dict[str, list[float]]:
    """Per-round step times (seconds) of each system, the systems taking turns within each round."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for i in range(WARMUP + STEPS):
        for name, (step, _) in systems.items():
            dist.barrier()
            start = time.perf_counter()
            step(i)
            dist.barrier()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return times


def _breakdown(rank: int) -> dict[str, float]:
    """One cx ep2 layer step split into its phases (median seconds over the steps)."""
    import transformers

    torch.manual_seed(0)
    config = _config()
    config._experts_implementation = "grouped_mm"
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    for p in block.parameters():
        nn.init.normal_(p, std=0.02)
    expert_parallelize_hf(block, dist.group.WORLD)  # type: ignore[arg-type]
    from cx_moe import expert_mlp

    phases: dict[str, list[float]] = {k: [] for k in ("router", "dispatch", "experts", "combine", "backward")}
    experts: Any = block.experts
    for i in range(WARMUP + STEPS):
        g = torch.Generator().manual_seed(i + rank)
        x = torch.randn(TOKENS, HIDDEN, generator=g)
        dist.barrier()
        marks = [time.perf_counter()]
        _, weights, indices = block.gate(x)
        marks.append(time.perf_counter())
        rows, counts, plan = dispatch(x, indices, EXPERTS, dist.group.WORLD)
        marks.append(time.perf_counter())
        out = expert_mlp(rows, counts, experts.gate_up_proj, experts.down_proj, experts.act_fn, gated=True)
        marks.append(time.perf_counter())
        y = combine(out, plan, weights)
        marks.append(time.perf_counter())
        (y * torch.randn(y.shape, generator=g)).sum().backward()
        marks.append(time.perf_counter())
        if i >= WARMUP:
            for k, (a, b) in zip(phases, itertools.pairwise(marks), strict=True):
                phases[k].append(b - a)
    return {k: statistics.median(v) for k, v in phases.items()}


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for kind in ("layer", "model"):
        systems = _systems(kind, rank)
        result[kind] = _time(systems)
        result[f"{kind} expert bytes"] = {name: _expert_bytes(m) for name, (_, m) in systems.items()}
    result["breakdown"] = _breakdown(rank)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "result.json")
        spawn(_worker, 2, path, timeout=1200)
        result = json.loads(Path(path).read_text())
    tokens = {"layer": TOKENS, "model": BATCH * SEQ}
    for kind, title in (("layer", "one MoE layer, fwd+bwd+reduce"), ("model", "tiny Mixtral training step")):
        rounds = result[kind]
        print(f"\n{title} ({tokens[kind]} tokens per rank), 2 ranks; ratios: medians of per-round ratios")
        print(
            "| system | median ms | tokens/s (both ranks) | time / replicated | time / transformers ep2 | "
            "expert MB per rank |"
        )
        print("|---|---|---|---|---|---|")
        for name, t in rounds.items():
            median = statistics.median(t)
            vs_replicated = statistics.median(a / b for a, b in zip(t, rounds["replicated"], strict=True))
            vs_hf = statistics.median(a / b for a, b in zip(t, rounds["transformers ep2"], strict=True))
            mb = result[f"{kind} expert bytes"][name] / 2**20
            print(
                f"| {name} | {median * 1e3:.1f} | {2 * tokens[kind] / median:,.0f} | {vs_replicated:.2f} | "
                f"{vs_hf:.2f} | {mb:.2f} |"
            )
    phases = result["breakdown"]
    total = sum(phases.values())
    print("\ncx ep2 layer step by phase (rank 0)")
    print("| phase | median ms | share |")
    print("|---|---|---|")
    for k, v in phases.items():
        print(f"| {k} | {v * 1e3:.1f} | {v / total:.0%} |")


if __name__ == "__main__":
    main()
