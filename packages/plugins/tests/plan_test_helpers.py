"""Measuring what the planner predicts: the peak tensor bytes of one training step on each rank, on this CPU.

`measure_step_peak` runs on every rank (cx_mesh.testing.run_distributed): the model cx-train builds, the plugin of
the Candidate, torch AdamW; one step first (so the optimizer states exist, as in every later step), then a second
step under torch's `MemTracker` (every live tensor: parameters, gradients, optimizer states, activations, buffers),
whose peak each rank writes to `out/<rank>.json`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from cx_plugins import (
    Booster,
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    MoeHybridParallelPlugin,
    Plugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from cx_plugins.demo._models import ModelSpec, build_model, describe_model
from cx_plugins.fsdp import block_wrap_policy
from cx_plugins.plan import Candidate
from cx_plugins.plan._measure import LiveBytes  # follows storage resizes (FSDP, cx-chunk) too

__all__ = ["measure_step_peak", "read_peaks"]


def _plugin(candidate: Candidate, module: torch.nn.Module) -> Plugin:
    arguments: dict[str, Any] = candidate.plugin_arguments()
    if candidate.plugin == "torch_ddp":
        return TorchDDPPlugin()
    if candidate.plugin == "torch_fsdp":  # per block: each decoder layer its own fully_shard, as cx-train does
        return TorchFSDPPlugin(auto_wrap_policy=block_wrap_policy(module) if candidate.fsdp_wrap == "block" else None)
    if candidate.plugin == "low_level_zero":
        return LowLevelZeroPlugin(**arguments)
    if candidate.plugin == "gemini":  # small chunks, as cx-train uses for its small models
        return GeminiPlugin(search_range_m=1, min_chunk_size_m=0.05, hidden_dim=64, **arguments)
    if candidate.plugin == "moe_hybrid":
        return MoeHybridParallelPlugin(**arguments)
    return HybridParallelPlugin(**arguments)


def measure_step_peak(
    rank: int, world_size: int, *, model: str, fields: dict[str, Any], hidden: int, layers: int, seq_len: int, out: str
) -> None:
    candidate = Candidate(**fields)
    assert candidate.world_size == world_size
    with LiveBytes() as tracker:  # from the start: ZeRO partitions and Gemini chunks are reachable from no module
        step = _prepare(rank, candidate, model, hidden, layers, seq_len)
        step()  # the optimizer states exist from the first step on, as in every later one
        tracker.peak = tracker.live
        step()
    Path(out, f"{rank}.json").write_text(json.dumps({"peak": tracker.peak}))


def _prepare(rank: int, candidate: Candidate, model: str, hidden: int, layers: int, seq_len: int) -> Callable[[], None]:
    described = describe_model(ModelSpec(model, hidden, layers, seq_len))
    module = build_model(described, seed=0)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    mixed = None if candidate.plugin not in ("torch_ddp", "torch_fsdp") or candidate.precision == "fp32" else "bf16"
    booster = Booster(plugin=_plugin(candidate, module), mixed_precision=mixed)
    boosted, wrapped, *_ = booster.boost(module, optimizer)
    assert wrapped is not None
    vocab = described.tokenizer.vocab_size
    batch = candidate.micro_batch_size * candidate.num_microbatches
    ids = (torch.arange(batch * seq_len) * 7).reshape(batch, seq_len) % vocab

    def step() -> None:
        if candidate.pp > 1:
            data = iter([{"input_ids": ids, "labels": ids}])
            booster.execute_pipeline(data, boosted, lambda output, _: output.loss, wrapped)
        else:
            output = boosted(input_ids=ids, labels=ids)
            loss = output if isinstance(output, torch.Tensor) else output.loss
            booster.backward(loss, wrapped)
        wrapped.step()
        wrapped.zero_grad()

    return step


def read_peaks(out: Path) -> list[int]:
    return [json.loads(p.read_text())["peak"] for p in sorted(out.glob("*.json"))]
