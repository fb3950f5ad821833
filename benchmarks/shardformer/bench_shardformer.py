"""cx ShardFormer tensor (and sequence) parallelism vs torch DTensor TP and vs one process, tiny HF Llama, CPU, gloo.

Run: `OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .nox/tests/bin/python benchmarks/shardformer/bench_shardformer.py`
(`CX_BENCH_SMOKE=1` for a seconds-long check). Two processes, one thread each. Every system holds its own copy of
the same model (transformers LlamaForCausalLM from a config: 4 layers, hidden 256, 8 heads / 4 key-value heads,
intermediate 688, vocab 4096, seq 128, batch 8 per step, fp32, torch AdamW) and they take turns step by step, so
machine noise hits all alike; a step is forward + loss + backward + AdamW + barrier, and each ratio is the median of
per-round ratios. Systems:
- one process: rank 0 trains the unsharded model while rank 1 waits at the barrier;
- DTensor TP: `parallelize_module` with the config's `base_model_tp_plan` (Colwise/RowwiseParallel) plus the LM
  head as `ColwiseParallel(output_layouts=Replicate())` (transformers' "colwise_gather_output");
- cx TP, generic plan: `ShardFormer` with `TPPlanPolicy` and `parallel_output=False` (the same layers and the same
  gathered logits as the DTensor system: like for like);
- cx TP, Llama policy: the checked policy (vocabulary-parallel embedding, head and loss, `parallel_output=True`);
- cx SP: split_gather (tp 2), all_to_all (sp 2, no tp) and ring (sp 2, no tp).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cx_mesh.testing import spawn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tiny models
from bench_models import tiny_llama
from bench_timing import time_in_turns

LAYERS, HIDDEN, HEADS, KV_HEADS, INTER, VOCAB, SEQ, BATCH = 4, 256, 8, 4, 688, 4096, 128, 8
WARMUP, STEPS = 2, 10
if os.environ.get("CX_BENCH_SMOKE"):
    LAYERS, HIDDEN, INTER, VOCAB, SEQ, BATCH, STEPS = 1, 32, 64, 128, 16, 2, 2

Step = Callable[[torch.Tensor], None]


def _model() -> Any:
    return tiny_llama(layers=LAYERS, hidden=HIDDEN, intermediate=INTER, vocab=VOCAB, seq=SEQ, kv_heads=KV_HEADS)


def _trainer(model: Any) -> Step:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()

    return step


def _single(rank: int) -> Step:
    train = _trainer(_model()) if rank == 0 else None

    def step(ids: torch.Tensor) -> None:
        if train is not None:
            train(ids)

    return step


def _dtensor() -> Step:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan: dict[str, Any] = {f"model.{key}": styles[style]() for key, style in model.config.base_model_tp_plan.items()}
    plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh, plan)
    return _trainer(model)


def _cx(**config: Any) -> Step:
    from cx_shardformer import ShardConfig, ShardFormer
    from cx_shardformer.policies import TPPlanPolicy

    generic = config.pop("generic", False)
    model, _ = ShardFormer(ShardConfig(**config)).optimize(_model(), TPPlanPolicy() if generic else None)
    return _trainer(model)


def _worker(rank: int, world_size: int, out: str) -> None:
    torch.set_num_threads(1)
    systems: dict[str, Step] = {
        "one process": _single(rank),
        "DTensor TP (tp plan)": _dtensor(),
        "cx TP, generic plan policy": _cx(generic=True, parallel_output=False),
        "cx TP, Llama policy": _cx(),
        "cx SP split_gather (tp 2)": _cx(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather"),
        "cx SP all_to_all (sp 2)": _cx(
            enable_tensor_parallelism=False, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all"
        ),
        "cx SP ring (sp 2)": _cx(
            enable_tensor_parallelism=False, enable_sequence_parallelism=True, sequence_parallelism_mode="ring"
        ),
    }
    times = time_in_turns(systems, _batch, WARMUP, STEPS)
    if rank == 0:
        result = {name: statistics.median(values) for name, values in times.items()}
        ratios = {
            f"{name} / {base}": statistics.median(a / b for a, b in zip(times[name], times[base], strict=True))
            for name in times
            for base in ("DTensor TP (tp plan)", "one process")
            if name != base
        }
        Path(out).write_text(json.dumps({"ms": result, "ratios": ratios}))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "result.json")
        spawn(_worker, 2, path, timeout=900)
        result = json.loads(Path(path).read_text())
    print(f"Llama {LAYERS} layers, hidden {HIDDEN}, heads {HEADS}/{KV_HEADS}, vocab {VOCAB}, seq {SEQ}, batch {BATCH}")
    for name, ms in result["ms"].items():
        print(f"{name:32s} {ms:8.1f} ms")
    for label, ratio in result["ratios"].items():
        print(f"ratio {label}: {ratio:.2f}")
    sys.stdout.flush()


def _batch(index: int) -> torch.Tensor:
    """The seeded batch of step `index`, the same on every rank and for every system."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(index))


if __name__ == "__main__":
    main()
