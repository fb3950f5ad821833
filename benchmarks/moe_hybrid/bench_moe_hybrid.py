"""cx MoeHybridParallelPlugin (ep 2, ZeRO-1 and ZeRO-2) vs torch DDP with replicated experts vs transformers' own
expert parallelism + DDP: training step time and memory per rank, tiny HF Mixtral, 2 processes, CPU, gloo.

Run: `OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo HF_HUB_OFFLINE=1 .nox/tests/bin/python
benchmarks/moe_hybrid/bench_moe_hybrid.py` (a few minutes on 2 shared cores; `CX_BENCH_SMOKE=1` for a seconds-long
check that the script works, `CX_BENCH_STEPS=n` for more measured rounds).

Every system holds its own copy of the same model (transformers 5 `MixtralForCausalLM` from a config, fused experts,
`output_router_logits=True` so the aux loss is in the loss, fp32, torch AdamW) and trains on the same rows, each rank
its own. A step is forward + loss + backward + gradient reduction + AdamW + zero_grad + barrier. The systems take
turns step by step, the order reversed every other round, so machine noise hits all alike; each ratio is the median
of the per-round ratios. Systems:
- DDP (replicated): `DistributedDataParallel(gradient_as_bucket_view=True)` over the whole model; every rank holds
  every expert, every gradient is all-reduced.
- transformers EP + DDP: `transformers.distributed.expert_parallel.apply_expert_parallelism` with the config's
  `base_model_ep_plan` styles (`grouped_gemm` shards the fused experts over ep, `ep_dispatch_experts` with
  `ep_implementation="all_to_all"` exchanges the routed tokens), DDP over the dense parameters (the expert ones
  ignored: with moe_dp 1 each expert slice lives on one rank), the expert gradients divided by ep (they come out
  summed over the ep ranks' batches) so both train the same model.
- cx ep2 zero0 / zero1 / zero2: `MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=0, 1 or 2,
  precision="fp32")` through the Booster (zero 1 and 2 are the issue's comparison; zero 0 shows what the ZeRO
  machinery costs on top), and zero 1 / 2 again with `zero_bucket_size_in_m=1` instead of the default 12 (buckets
  of 4 MB instead of 48 MB: below glibc's mmap threshold, so they are not fresh pages every step).
Two configurations: "dense-heavy" (4 small experts, big vocabulary: experts are a small share of the parameters) and
"expert-heavy" (16 experts of intermediate 1024: experts are almost all of them).

Memory per rank: bytes of the live tensors each system adds (all of its storages reachable from Python, counted once
by storage, measured after the backward and optimizer step of its first step, before zero_grad): parameters, their
`.grad`s, and the rest (optimizer state, ZeRO's flat buffers and master shards, DDP's buckets are the gradients
themselves with `gradient_as_bucket_view`).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import spawn

SMOKE = bool(os.environ.get("CX_BENCH_SMOKE"))
WARMUP, STEPS = 2, int(os.environ.get("CX_BENCH_STEPS", 2 if SMOKE else 10))
SEQ, BATCH = (16, 2) if SMOKE else (128, 4)  # rows of SEQ tokens per rank and step
EP = 2


@dataclass(frozen=True)
class Shape:
    """A Mixtral size: what changes between the dense-heavy and the expert-heavy configuration."""

    name: str
    hidden: int
    layers: int
    vocab: int
    experts: int
    expert_intermediate: int


SHAPES = (
    (Shape("dense-heavy", 64, 2, 256, 4, 32), Shape("expert-heavy", 64, 2, 128, 8, 128))
    if SMOKE
    else (Shape("dense-heavy", 256, 2, 8192, 4, 128), Shape("expert-heavy", 256, 2, 1024, 16, 1024))
)


@dataclass
class System:
    """One system under test: a training step on this rank's rows (without zero_grad), zero_grad, its model."""

    train: Callable[[torch.Tensor], float]
    clear: Callable[[], None]
    model: nn.Module


def _config(shape: Shape) -> Any:
    import transformers

    return transformers.MixtralConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.expert_intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_local_experts=shape.experts, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
        tie_word_embeddings=False, use_cache=False,
    )  # fmt: skip


def _model(shape: Shape) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    model: nn.Module = transformers.MixtralForCausalLM(_config(shape))
    return model


def _is_expert(name: str) -> bool:
    return ".experts." in name


def _ddp(shape: Shape) -> System:
    from torch.nn.parallel import DistributedDataParallel

    net = _model(shape)
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return System(train, optimizer.zero_grad, net)


def _hf_ep(shape: Shape) -> System:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    net = _model(shape)
    mesh = init_device_mesh("cpu", (EP, 1), mesh_dim_names=("ep", "tp"))
    rules: dict[str, str] = getattr(net.config, "base_model_ep_plan")  # noqa: B009 (a transformers config field)
    # The plan in the rules' order, per layer: the expert parameters are sharded before the dispatch is installed
    # (it reads the local expert count the `grouped_gemm` shard leaves; the other way round it routes wrongly).
    layers = [name for name, _ in net.named_modules() if _matches(name, "model.layers.*")]
    plan = {f"{layer}.{rule.removeprefix('layers.*.')}": style for layer in layers for rule, style in rules.items()}
    apply_expert_parallelism(net, mesh["ep"], mesh["tp"], plan, ep_implementation="all_to_all")
    experts = [p for n, p in net.named_parameters() if _is_expert(n)]
    assert experts, "transformers' EP plan matched no expert parameter"
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        net, [n for n, _ in net.named_parameters() if _is_expert(n)]
    )
    model = DistributedDataParallel(net, gradient_as_bucket_view=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for param in experts:  # summed over the ep ranks' batches; DDP averages the dense ones
            if param.grad is not None:
                param.grad.div_(EP)
        optimizer.step()
        return float(loss.detach())

    return System(train, optimizer.zero_grad, net)


def _matches(name: str, pattern: str) -> bool:
    """`model.layers.3.mlp.experts` against `model.layers.*.mlp.experts` (a `*` stands for one layer index)."""
    parts, wanted = name.split("."), pattern.split(".")
    return len(parts) == len(wanted) and all(w in ("*", p) for p, w in zip(parts, wanted, strict=True))


def _cx(shape: Shape, zero_stage: int, bucket_m: int = 12) -> System:
    from cx_plugins import Booster, MoeHybridParallelPlugin

    plugin = MoeHybridParallelPlugin(
        tp_size=1, pp_size=1, ep_size=EP, zero_stage=zero_stage, precision="fp32", zero_bucket_size_in_m=bucket_m
    )
    booster = Booster(plugin=plugin)
    net = _model(shape)
    model, optimizer, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    assert optimizer is not None
    boosted_optimizer = optimizer

    def train(ids: torch.Tensor) -> float:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, boosted_optimizer)
        boosted_optimizer.step()
        return float(loss.detach())

    return System(train, boosted_optimizer.zero_grad, net)


def _storages() -> dict[int, int]:
    """Every tensor storage reachable from Python (a DTensor counted by its local tensor): data pointer -> bytes."""
    found: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated module-level aliases warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        tensor = getattr(obj, "_local_tensor", obj)
        if tensor.is_meta or tensor.layout != torch.strided:
            continue
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        if storage.data_ptr():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _bytes_of(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        if not local.is_meta:
            seen[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(seen.values())


def _rows(index: int, rank: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * index + rank)
    return torch.randint(0, vocab, (BATCH, SEQ), generator=generator)


def _build(shape: Shape, rank: int) -> tuple[dict[str, System], dict[str, dict[str, int]], dict[str, float]]:
    """Build the systems one after the other, each taking its first step right away, measuring what it adds."""
    builders: dict[str, Callable[[], System]] = {
        "DDP (replicated experts)": lambda: _ddp(shape),
        "transformers EP + DDP": lambda: _hf_ep(shape),
        "cx ep2 zero0": lambda: _cx(shape, 0),
        "cx ep2 zero1": lambda: _cx(shape, 1),
        "cx ep2 zero2": lambda: _cx(shape, 2),
        "cx ep2 zero1 bucket 1M": lambda: _cx(shape, 1, bucket_m=1),
        "cx ep2 zero2 bucket 1M": lambda: _cx(shape, 2, bucket_m=1),
    }
    systems: dict[str, System] = {}
    memory: dict[str, dict[str, int]] = {}
    first_loss: dict[str, float] = {}
    for name, build in builders.items():
        gc.collect()
        before = _storages()
        system = build()
        first_loss[name] = system.train(_rows(0, rank, shape.vocab))
        gc.collect()
        added = {ptr: size for ptr, size in _storages().items() if ptr not in before}
        params = list(system.model.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        total = sum(added.values())
        memory[name] = {"params": _bytes_of(list(params)), "grads": _bytes_of(grads), "total": total}
        memory[name]["rest"] = total - memory[name]["params"] - memory[name]["grads"]
        system.clear()
        systems[name] = system
        dist.barrier()
    return systems, memory, first_loss


def _time(systems: dict[str, System], rank: int, vocab: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per-round step times (ms), the systems taking turns, the order reversed every other round; and each system's
    loss in the first round (after one AdamW update: equal when the systems trained the same model)."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    second_loss: dict[str, float] = {}
    names = list(systems)
    for index in range(1, 1 + WARMUP + STEPS):
        ids = _rows(index, rank, vocab)
        for name in names if index % 2 else reversed(names):
            system = systems[name]
            dist.barrier()
            start = time.perf_counter()
            loss = system.train(ids)
            system.clear()
            dist.barrier()
            if index > WARMUP:
                times[name].append((time.perf_counter() - start) * 1e3)
            if index == 1:
                second_loss[name] = loss
    return times, second_loss


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    for shape in SHAPES:
        systems, memory, first_loss = _build(shape, rank)
        times, second_loss = _time(systems, rank, shape.vocab)
        sizes = [torch.zeros(len(memory), 4, dtype=torch.float64) for _ in range(world_size)]
        table = [[m["params"], m["grads"], m["rest"], m["total"]] for m in memory.values()]
        dist.all_gather(sizes, torch.tensor(table, dtype=torch.float64))
        full = sum(p.numel() for p in _model(shape).parameters())
        experts = sum(p.numel() for n, p in _model(shape).named_parameters() if _is_expert(n))
        results.append({
            "shape": asdict(shape), "parameters": full, "expert_share": experts / full,
            "ms": {name: statistics.median(t) for name, t in times.items()},
            "rounds": times, "losses": {name: [first_loss[name], second_loss[name]] for name in first_loss},
            "memory_mib": {name: [[float(x) / 2**20 for x in s[i].tolist()] for s in sizes]
                           for i, name in enumerate(memory)},
        })  # fmt: skip
        del systems
        gc.collect()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def _ratio(rounds: dict[str, list[float]], name: str, base: str) -> float:
    return statistics.median(a / b for a, b in zip(rounds[name], rounds[base], strict=True))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "result.json")
        spawn(_worker, 2, path, timeout=3000)
        results = json.loads(Path(path).read_text())
    load = os.getloadavg()[0]
    print(f"2 processes, gloo, 1 thread each, {BATCH} x {SEQ} tokens per rank, {STEPS} rounds; load average {load:.1f}")
    for result in results:
        shape, rounds = result["shape"], result["rounds"]
        print(
            f"\n{shape['name']}: Mixtral hidden {shape['hidden']}, {shape['layers']} layers, vocab {shape['vocab']}, "
            f"{shape['experts']} experts of {shape['expert_intermediate']}, top-2; {result['parameters'] / 1e6:.2f}M "
            f"parameters, experts {result['expert_share']:.0%}"
        )
        print("| system | ms / step | / DDP | / transformers EP + DDP | loss at steps 1, 2 (rank 0) |")
        print("|---|---|---|---|---|")
        for name, ms in result["ms"].items():
            vs_ddp = _ratio(rounds, name, "DDP (replicated experts)")
            vs_hf = _ratio(rounds, name, "transformers EP + DDP")
            first, second = result["losses"][name]
            print(f"| {name} | {ms:.0f} | {vs_ddp:.2f} | {vs_hf:.2f} | {first:.6f}, {second:.6f} |")
        print("\n| system | params MiB | grads MiB | optimizer + buffers MiB | total MiB (rank 0 / rank 1) |")
        print("|---|---|---|---|---|")
        for name, per_rank in result["memory_mib"].items():
            p, g, r, t = per_rank[0]
            print(f"| {name} | {p:.1f} | {g:.1f} | {r:.1f} | {t:.1f} / {per_rank[1][3]:.1f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
