"""Save and load time of a tensor-parallel model's checkpoint: cx's HybridCheckpointIO (TP shards gathered into the
canonical Hugging Face layout, written in parallel) against torch.distributed.checkpoint on the same model made
tensor-parallel with DTensor (each rank writes its own shards in DCP's format). 2 ranks, tp 2, side by side.

    OMP_NUM_THREADS=1 python benchmarks/hybrid_checkpoint/bench_hybrid_checkpoint.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from cx_mesh.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared tiny models
from bench_models import tiny_llama


def _model(hidden: int, layers: int, vocab: int) -> Any:
    return tiny_llama(layers=layers, hidden=hidden, intermediate=hidden * 8 // 3 // 64 * 64, vocab=vocab, seq=64)


def _dtensor_tp(model: nn.Module, world: int) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan: dict[str, Any] = {"lm_head": ColwiseParallel()}
    for number in range(len(model.model.layers)):  # type: ignore[union-attr, arg-type]
        prefix = f"model.layers.{number}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _full_then_safetensors(model: nn.Module, path: str) -> None:
    """The torch-native way to an HF-loadable file from a DTensor TP model: gather every tensor (`full_tensor`, on
    every rank), rank 0 writes one safetensors file and fsyncs it."""
    state = {k: (v.full_tensor() if isinstance(v, DTensor) else v).contiguous() for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        save_file(state, path, metadata={"format": "pt"})
        with open(path, "rb+") as handle:
            os.fsync(handle.fileno())


def _timed(step: Any, *args: Any, **kwargs: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    step(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start


def _bench(rank: int, world_size: int, hidden: int, layers: int, vocab: int, repeats: int, out: str) -> None:
    from cx_plugins import HybridCheckpointIO
    from cx_plugins._layout import FILL, Axis, ParallelLayout
    from cx_shardformer import ShardConfig, ShardFormer

    layout = ParallelLayout.build([(Axis.DP, FILL), (Axis.PP, 1), (Axis.TP, world_size)], data_axes=(Axis.DP,))

    class View(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module
            self.layout = layout

        def unwrap(self) -> nn.Module:
            return self.module

        def held_parameter_names(self) -> frozenset[str]:
            return frozenset(n for n, _ in self.module.named_parameters())

        def held_buffer_names(self) -> frozenset[str]:
            return frozenset()

    sharded = _model(hidden, layers, vocab)
    ShardFormer(ShardConfig(tensor_parallel_process_group=layout.group(Axis.TP))).optimize(sharded)
    view = View(sharded)
    io = HybridCheckpointIO(lambda _: None)
    peer = _dtensor_tp(_model(hidden, layers, vocab), world_size)
    root = Path(out)
    times: dict[str, list[float]] = {
        "cx save": [], "cx load": [], "dcp save": [], "dcp load": [], "full_tensor + safetensors save": []
    }  # fmt: skip
    for repeat in range(repeats + 1):  # the first round warms up
        cx_dir, dcp_dir = str(root / f"cx{repeat}"), str(root / f"dcp{repeat}")
        measured = {
            "cx save": _timed(io.save_model, view, cx_dir, shard=True, use_safetensors=True),
            "cx load": _timed(io.load_model, view, cx_dir),
            "dcp save": _timed(dcp.save, peer.state_dict(), checkpoint_id=dcp_dir),  # type: ignore[attr-defined]
        }
        measured["dcp load"] = _timed(dcp.load, peer.state_dict(), checkpoint_id=dcp_dir)  # type: ignore[attr-defined]
        full_path = str(root / f"full{repeat}.safetensors")
        measured["full_tensor + safetensors save"] = _timed(_full_then_safetensors, peer, full_path)
        if repeat:
            for key, value in measured.items():
                times[key].append(value)
    if rank == 0:
        size = sum(p.numel() * p.element_size() for p in _model(hidden, layers, vocab).parameters()) / 1e6
        med = {key: statistics.median(values) for key, values in times.items()}
        print(f"model {size:.0f} MB fp32, {world_size} ranks tp{world_size}, median of {repeats}")
        for key, value in med.items():
            print(f"{key}: {value:.3f} s")
        print(f"ratio save cx/dcp: {med['cx save'] / med['dcp save']:.2f}")
        print(f"ratio load cx/dcp: {med['cx load'] / med['dcp load']:.2f}")
        full = med["full_tensor + safetensors save"]
        print(f"ratio save cx/(full_tensor + safetensors): {med['cx save'] / full:.2f}")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = tempfile.mkdtemp(prefix="cx-hybrid-ckpt-")
    try:
        run_distributed(
            _bench, 2, fresh=True, timeout=900, hidden=args.hidden, layers=args.layers, vocab=args.vocab,
            repeats=args.repeats, out=out,
        )  # fmt: skip
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
