"""fp8_communication per plugin: bytes each collective moves in one training step, and step time, fp8 vs bf16.

For every plugin that honours the switch (TorchDDPPlugin, TorchFSDPPlugin, LowLevelZeroPlugin stage 2,
GeminiPlugin, HybridParallelPlugin tp 2, MoeHybridParallelPlugin ep 2), 2 gloo ranks train a small HF model
(Llama; Mixtral for the MoE plugin) in bf16 twice, with `fp8_communication=False` and `True`: the bytes this rank
hands to each torch.distributed op during one whole step (forward, backward, optimizer step;
`cx_mesh.testing.count_collective_bytes`) and the median wall time of a step between barriers. Ratios are fp8 / bf16.
use_fp8 is off throughout: this measures the communication switch alone (fp8 matmuls are in bench_fp8.py).

    OMP_NUM_THREADS=1 GLOO_SOCKET_IFNAME=lo python benchmarks/fp8/bench_plugins.py [--steps 5] [--hidden 256]
Appends (or replaces) its own section of benchmarks/fp8/RESULTS.md, between the plugin-table markers.
"""

from __future__ import annotations

import argparse
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
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.fsdp import MixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel

from cx_mesh.testing import count_collective_bytes, spawn
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

VOCAB, LENGTH, ROWS = 1024, 64, 4  # ROWS: global batch, split over the data-parallel ranks
START, END = "<!-- plugin tables:", "<!-- end plugin tables -->"


def _llama(hidden: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=LENGTH, num_hidden_layers=2, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _mixtral(hidden: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=LENGTH, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
        use_cache=False,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _fsdp(fp8: bool) -> Plugin:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    policy = ModuleWrapPolicy({LlamaDecoderLayer})
    return TorchFSDPPlugin(auto_wrap_policy=policy, mixed_precision=bf16, fp8_communication=fp8)


# name -> (plugin for fp8_communication=flag, Booster mixed_precision, model builder)
PLUGINS: dict[str, tuple[Callable[[bool], Plugin], str | None, Callable[[int], nn.Module]]] = {
    "TorchDDPPlugin": (lambda fp8: TorchDDPPlugin(fp8_communication=fp8), "bf16", _llama),
    "TorchFSDPPlugin": (_fsdp, None, _llama),
    "LowLevelZeroPlugin stage 2": (
        lambda fp8: LowLevelZeroPlugin(stage=2, precision="bf16", fp8_communication=fp8),
        None,
        _llama,
    ),
    "GeminiPlugin": (lambda fp8: GeminiPlugin(precision="bf16", fp8_communication=fp8), None, _llama),
    "HybridParallelPlugin tp 2": (
        lambda fp8: HybridParallelPlugin(tp_size=2, pp_size=1, precision="bf16", fp8_communication=fp8),
        None,
        _llama,
    ),
    "MoeHybridParallelPlugin ep 2": (
        lambda fp8: MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, precision="bf16", fp8_communication=fp8),
        None,
        _mixtral,
    ),
}


def _run(name: str, fp8: bool, hidden: int, steps: int) -> tuple[dict[str, int], float]:
    """Bytes per op of one whole step (the second, after warm-up) and the median step time in ms."""
    make_plugin, mixed_precision, make_model = PLUGINS[name]
    plugin = make_plugin(fp8)
    booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    model = make_model(hidden)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert optimizer is not None
    for ddp in [m for m in boosted.modules() if isinstance(m, DistributedDataParallel)]:
        if not fp8:  # DDP's built-in reduction runs in C++, unseen by the counter; torch's own Python hook is the same
            ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # all-reduce (sum, then divide), made visible
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()  # type: ignore[attr-defined]
    share = ROWS // dp_size
    generator = torch.Generator().manual_seed(0)
    times: list[float] = []
    counted: dict[str, int] = {}
    for step in range(steps + 1):
        ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)[dp_rank * share : (dp_rank + 1) * share]
        dist.barrier()
        start = time.perf_counter()
        with count_collective_bytes() as moved:
            loss = boosted(input_ids=ids, labels=ids).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
        if step == 1:
            counted = dict(moved.by_op)
        if step > 0:  # the first step builds buffers and state
            times.append(time.perf_counter() - start)
    return counted, 1000 * statistics.median(times)


def _worker(rank: int, world: int, names: list[str], hidden: int, steps: int, out: str) -> None:
    rows = []
    for name in names:
        bf16_bytes, bf16_ms = _run(name, False, hidden, steps)
        fp8_bytes, fp8_ms = _run(name, True, hidden, steps)
        for op in sorted(set(bf16_bytes) | set(fp8_bytes)):
            rows.append(
                {"plugin": name, "op": op, "bf16_bytes": bf16_bytes.get(op, 0), "fp8_bytes": fp8_bytes.get(op, 0)}
            )
        total_bf16, total_fp8 = sum(bf16_bytes.values()), sum(fp8_bytes.values())
        rows.append({"plugin": name, "op": "**total**", "bf16_bytes": total_bf16, "fp8_bytes": total_fp8})
        rows[-1].update(bf16_ms=bf16_ms, fp8_ms=fp8_ms)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _cell(row: dict[str, Any], key: str, spec: str) -> str:
    return format(row[key], spec) if key in row else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plugins", nargs="+", default=list(PLUGINS), choices=list(PLUGINS))
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--results", type=Path, default=Path(__file__).with_name("RESULTS.md"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        spawn(_worker, 2, args.plugins, args.hidden, args.steps, out, timeout=3600)
        rows: list[dict[str, Any]] = json.loads(Path(out).read_text())
    print(json.dumps(rows), file=sys.stderr)
    lines = [
        f"{START} `{' '.join(['python benchmarks/fp8/bench_plugins.py', *sys.argv[1:]])}`, torch {torch.__version__},"
        f" {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, hidden {args.hidden} -->",
        "",
        "### fp8_communication per plugin (2 gloo ranks, bf16 training; bytes this rank hands over in one step)",
        "",
        "| plugin | op | bf16 bytes | fp8 bytes | bytes fp8/bf16 | bf16 ms/step | fp8 ms/step | time fp8/bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = f"{row['fp8_bytes'] / row['bf16_bytes']:.4f}" if row["bf16_bytes"] else "-"
        time_ratio = f"{row['fp8_ms'] / row['bf16_ms']:.2f}" if "bf16_ms" in row else ""
        lines.append(
            f"| {row['plugin']} | {row['op']} | {row['bf16_bytes']} | {row['fp8_bytes']} | {ratio} | "
            f"{_cell(row, 'bf16_ms', '.1f')} | {_cell(row, 'fp8_ms', '.1f')} | {time_ratio} |"
        )
    lines.append(END)
    section = "\n".join(lines)
    text = args.results.read_text() if args.results.exists() else "# fp8 benchmark\n"
    if START in text:
        text = text.split(START, 1)[0].rstrip("\n") + "\n\n" + section + text.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    args.results.write_text(text)


if __name__ == "__main__":
    main()
