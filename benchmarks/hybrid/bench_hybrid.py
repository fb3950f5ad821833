"""cx HybridParallelPlugin vs torch's own machinery, tiny HF Llama, 2 processes, CPU, gloo.

Run: `OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .nox/tests/bin/python benchmarks/hybrid/bench_hybrid.py`
(`CX_BENCH_SMOKE=1` for a seconds-long check). Every system holds its own copy of the same model (transformers
LlamaForCausalLM from a config, fp32, torch AdamW) and they take turns step by step, so machine noise hits all alike;
a step is forward + loss + backward + AdamW + barrier, each ratio the median of per-round ratios. Systems:
- one process: rank 0 trains the unsplit model while rank 1 waits at the barrier;
- DTensor TP: `parallelize_module` with the config's `base_model_tp_plan`, the LM head `ColwiseParallel` with
  replicated output;
- cx tp 2: `HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32")` through the Booster;
- torch pipelining pp 2: `Schedule1F1B` over two `PipelineStage`s (embedding + first half of the layers; second half +
  norm + head), `n_microbatches=4`;
- cx pp 2: `HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=4, precision="fp32")` and
  `booster.execute_pipeline`; again with `num_layers_per_stage="balanced"` (layers split by matmul parameters: 3 / 1
  here, the head on the last stage outweighing a layer; torch's stages and the plain cx ones split 2 / 2);
- on 4 processes, torch-native tp 2 x pp 2: the same two pipeline stages, each tensor-parallel over its tp submesh of
  a (pp, tp) `DeviceMesh` with the config's `base_model_tp_plan` (the head colwise, replicated output), against cx
  `HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=4)`. 4 processes on a 2-core machine oversubscribe
  it: that ratio says more about scheduling than about either system.
Memory: parameter bytes each rank holds (meta tensors of other stages excluded) against the analytical share.

`--batch-check` measures only the cost of the check that the ranks of a replica are given the same batch (issue 22):
cx tp 2 and cx pp 2 as above, each with the check as shipped (a structure hash and one tiny all-gather per call,
reading back on the first calls and on a change of shapes), with it reading back on every call, and without it
(`model.batch_check = None`), taking turns step by step; plus the check's own time per call, timed alone over many
calls, over the step time (the precise figure: the paired step ratios carry this machine's noise of a few %).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cx_mesh.testing import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tiny models
from bench_models import tiny_llama
from bench_timing import time_in_turns

LAYERS, HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, SEQ, BATCH, MICRO = 4, 256, 8, 4, 688, 4096, 128, 8, 4
WARMUP, STEPS = 2, 10
if os.environ.get("CX_BENCH_SMOKE"):
    LAYERS, HIDDEN, INTER, VOCAB, SEQ, BATCH, STEPS = 2, 32, 64, 128, 16, 4, 2

Step = Callable[[torch.Tensor], None]
_LAST_MODEL: list[Any] = []  # the model _cx boosted last (the batch-check variants switch its check)


def _model() -> Any:
    return tiny_llama(layers=LAYERS, hidden=HIDDEN, intermediate=INTER, vocab=VOCAB, seq=SEQ, kv_heads=KV_HEADS)


def _held_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.device.type != "meta")


def _single(rank: int) -> tuple[Step, int]:
    model = _model() if rank == 0 else None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if model is not None else None

    def step(ids: torch.Tensor) -> None:
        if model is not None and optimizer is not None:
            optimizer.zero_grad()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()

    return step, _held_bytes(model) if model is not None else 0


def _dtensor() -> tuple[Step, int]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {f"model.{key}": styles[style]() for key, style in model.config.base_model_tp_plan.items()}
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    local = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in model.parameters())
    return step, local


def _cx(**options: Any) -> tuple[Step, int]:
    from cx_plugins import Booster, HybridParallelPlugin

    plugin = HybridParallelPlugin(precision="fp32", **options)
    booster = Booster(plugin=plugin)
    net = _model()
    model, optimizer, *_ = booster.boost(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    assert optimizer is not None
    _LAST_MODEL[:] = [model]

    def step(ids: torch.Tensor) -> None:
        batch = {"input_ids": ids, "labels": ids}
        if plugin.pp_size > 1:
            booster.execute_pipeline(iter([batch]), model, lambda out, _: out.loss, optimizer)
        else:
            booster.backward(model(**batch).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()

    return step, _held_bytes(model)


class _TorchStage(nn.Module):
    """Half of the Llama for torch.distributed.pipelining: positional tensor in, tensor out."""

    def __init__(self, model: Any, first: bool) -> None:
        super().__init__()
        half = LAYERS // 2
        self.first = first
        self.embed = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[:half] if first else model.model.layers[half:])
        self.rotary = model.model.rotary_emb
        self.norm = None if first else model.model.norm
        self.head = None if first else model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        embeddings = self.rotary(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, position_ids=positions, position_embeddings=embeddings)
        if self.norm is not None and self.head is not None:
            out: torch.Tensor = self.head(self.norm(hidden))
            return out
        return hidden


def _tensor_parallel_stage(stage_module: _TorchStage, tp_mesh: Any) -> None:
    """DTensor TP on one pipeline stage: the config's plan for its layers, the head colwise with replicated output."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {key: styles[style]() for key, style in _model().config.base_model_tp_plan.items()}
    if stage_module.head is not None:
        plan["head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(stage_module, tp_mesh, plan)


def _torch_pipeline(
    rank: int, tp_mesh: Any = None, pp_group: Any = None, pp_rank: int | None = None
) -> tuple[Step, int]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    stage_index = rank if pp_rank is None else pp_rank
    stage_module = _TorchStage(_model(), first=stage_index == 0)
    if tp_mesh is not None:
        _tensor_parallel_stage(stage_module, tp_mesh)
    stage = PipelineStage(stage_module, stage_index, 2, torch.device("cpu"), group=pp_group)
    rank = stage_index

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

    schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids)
        optimizer.step()
        optimizer.zero_grad()

    local = sum(getattr(p, "_local_tensor", p).numel() * p.element_size() for p in stage_module.parameters())
    return step, local


def _cx_check_variants(prefix: str, **options: Any) -> dict[str, tuple[Step, Any]]:
    """cx with the batch check as shipped, reading back every call, and off; each step with its boosted model."""
    variants = {}
    for suffix in ("", " (check reads every call)", " (no check)"):
        step, _ = _cx(**options)
        model = _LAST_MODEL[0]
        if "every" in suffix:
            model.batch_check.first_calls = 10**9
        elif "no check" in suffix:
            model.batch_check = None
        variants[prefix + suffix] = (step, model)
    return variants


def _check_alone(model: Any, ids: torch.Tensor, look: bool, calls: int = 200) -> float:
    """ms per call of the model's batch check alone (every rank calling it together)."""
    check = model.batch_check
    saved = check.first_calls
    check.first_calls = 10**9 if look else 0
    batch = {"input_ids": ids, "labels": ids}
    check(batch)  # a structure change reads back once; the timed calls then follow the `look` mode
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        check(batch)
    dist.barrier()
    check.first_calls = saved
    return (time.perf_counter() - start) * 1e3 / calls


def _worker_check(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    built = {**_cx_check_variants("cx tp 2", tp_size=2, pp_size=1)}
    built.update(_cx_check_variants("cx pp 2 (1F1B)", tp_size=1, pp_size=2, num_microbatches=MICRO))
    times = _time({name: step for name, (step, _) in built.items()})
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    alone = {}
    for prefix in ("cx tp 2", "cx pp 2 (1F1B)"):
        model = built[prefix][1]
        step_ms = statistics.median(times[prefix + " (no check)"])
        for look in (False, True):
            ms = _check_alone(model, ids, look)
            alone[f"{prefix}: check alone ({'reading back' if look else 'as on later calls'}) / step"] = ms / step_ms
    if rank == 0:
        ratios = {}
        for prefix in ("cx tp 2", "cx pp 2 (1F1B)"):
            base = times[prefix + " (no check)"]
            for name in (prefix, prefix + " (check reads every call)"):
                ratios[f"{name} / {prefix} (no check)"] = statistics.median(
                    a / b for a, b in zip(times[name], base, strict=True)
                )
        ratios.update(alone)
        result = {"ms": {n: statistics.median(v) for n, v in times.items()}, "ratios": ratios}
        Path(out).write_text(json.dumps(result))


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    built = {
        "one process": _single(rank),
        "DTensor TP": _dtensor(),
        "cx tp 2": _cx(tp_size=2, pp_size=1),
        "torch pipelining pp 2 (1F1B)": _torch_pipeline(rank),
        "cx pp 2 (1F1B)": _cx(tp_size=1, pp_size=2, num_microbatches=MICRO),
        "cx pp 2 (1F1B, balanced)": _cx(tp_size=1, pp_size=2, num_microbatches=MICRO, num_layers_per_stage="balanced"),
    }
    systems = {name: step for name, (step, _) in built.items()}
    held = {name: size for name, (_, size) in built.items()}
    times = _time(systems)
    sizes = [torch.zeros(len(held), dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor(list(held.values()), dtype=torch.float64))
    if rank == 0:
        pipelining = "torch pipelining pp 2 (1F1B)"
        pairs = (
            ("cx tp 2", "DTensor TP"),
            ("cx pp 2 (1F1B)", pipelining),
            ("cx pp 2 (1F1B, balanced)", pipelining),
        )
        ratios = {
            f"{name} / {base}": statistics.median(a / b for a, b in zip(times[name], times[base], strict=True))
            for name, base in pairs + tuple((name, "one process") for name in systems if name != "one process")
        }
        memory = {name: [float(s[i]) / 2**20 for s in sizes] for i, name in enumerate(held)}
        result = {"ms": {n: statistics.median(v) for n, v in times.items()}, "ratios": ratios, "param_mib": memory}
        Path(out).write_text(json.dumps(result))


def _time(systems: dict[str, Step]) -> dict[str, list[float]]:
    """Step times in ms, the systems taking turns step by step (machine noise hits all alike)."""
    return time_in_turns(systems, _batch, WARMUP, STEPS)


def _batch(index: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(index))


def _worker_4(rank: int, world_size: int, out: str) -> None:
    """tp 2 x pp 2 on 4 processes: torch's DTensor TP inside torch pipelining stages vs cx."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    built = {
        "torch tp 2 x pp 2": _torch_pipeline(
            rank, tp_mesh=mesh["tp"], pp_group=mesh["pp"].get_group(), pp_rank=mesh["pp"].get_local_rank()
        ),
        "cx tp 2 x pp 2": _cx(tp_size=2, pp_size=2, num_microbatches=MICRO),
    }
    times = _time({name: step for name, (step, _) in built.items()})
    sizes = [torch.zeros(len(built), dtype=torch.float64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([size for _, size in built.values()], dtype=torch.float64))
    if rank == 0:
        ratio = statistics.median(
            a / b for a, b in zip(times["cx tp 2 x pp 2"], times["torch tp 2 x pp 2"], strict=True)
        )
        memory = {name: [float(s[i]) / 2**20 for s in sizes] for i, name in enumerate(built)}
        result = {
            "ms": {n: statistics.median(v) for n, v in times.items()},
            "ratios": {"cx tp 2 x pp 2 / torch tp 2 x pp 2": ratio},
            "param_mib": memory,
        }
        Path(out).write_text(json.dumps(result))


def main() -> None:
    if "--help" in sys.argv or "-h" in sys.argv:
        print(__doc__)
        return
    if "--batch-check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            path = str(Path(tmp) / "check.json")
            spawn(_worker_check, 2, path, timeout=1200)
            result = json.loads(Path(path).read_text())
        print(f"Llama {LAYERS} layers, hidden {HIDDEN}, vocab {VOCAB}, seq {SEQ}, batch {BATCH}, {STEPS} steps")
        for name, ms in result["ms"].items():
            print(f"{name:45s} {ms:8.1f} ms")
        for label, ratio in result["ratios"].items():
            print(f"ratio {label}: {ratio:.4f}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        path, path_4 = str(Path(tmp) / "result.json"), str(Path(tmp) / "result_4.json")
        spawn(_worker, 2, path, timeout=1200)
        spawn(_worker_4, 4, path_4, timeout=1200)
        result = json.loads(Path(path).read_text())
        four = json.loads(Path(path_4).read_text())
        for key in ("ms", "ratios"):
            result[key].update(four[key])
        result["param_mib_4"] = four["param_mib"]
    print(f"Llama {LAYERS} layers, hidden {HIDDEN}, heads {HEADS}/{KV_HEADS}, vocab {VOCAB}, seq {SEQ}, batch {BATCH}")
    for name, ms in result["ms"].items():
        print(f"{name:32s} {ms:8.1f} ms")
    for label, ratio in result["ratios"].items():
        print(f"ratio {label}: {ratio:.2f}")
    full = result["param_mib"]["one process"][0]
    for name, per_rank in result["param_mib"].items():
        print(f"parameters held {name:32s} " + " ".join(f"{m:7.2f} MiB" for m in per_rank) + f" (full {full:.2f})")
    for name, per_rank in result["param_mib_4"].items():
        line = " ".join(f"{m:7.2f} MiB" for m in per_rank)
        print(f"parameters held {name:32s} {line} (analytical share full / 4 = {full / 4:.2f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
