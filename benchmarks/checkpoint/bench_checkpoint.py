"""Save/load throughput of a ~1 GiB state dict: cx-checkpoint beside torch.save/load, safetensors and DCP (2 ranks).

Every writer's time includes an fsync of what it wrote (cx fsyncs as part of its atomic commit; the others are
fsynced right after), so all figures are durable writes; the raw disk figure is writing the same bytes with one
`write` + `fsync`. Loads read from the page cache (the files were just written; the cache is not dropped on a shared
machine), so they measure deserialisation and copying, not the disk. Median of `--repeats` runs, GB = 1e9 bytes.

cx records a CRC-32 per shard file (a data checksum for single files) while saving, so its save figures include that
cost; the checksum's own time over the same bytes is reported beside them, and `load_model(verify=True)` (every file
read and checked before loading) is timed against the plain load.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/checkpoint/bench_checkpoint.py [--gib 1.0] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save_fn

import cx_checkpoint._checksum as checksum_module  # benchmark only: switch checksums off for a reference row
from cx_checkpoint import CheckpointReader, GeneralCheckpointIO, write_sharded
from cx_mesh.testing import spawn

TENSOR_SHAPE = (1024, 4096)  # 16 MiB float32 each


def tensor_count(gib: float) -> int:
    return max(2, round(gib * 1024**3 / (TENSOR_SHAPE[0] * TENSOR_SHAPE[1] * 4)))


def make_state(gib: float, rank: int = 0, world_size: int = 1) -> dict[str, torch.Tensor]:
    """Tensor i (seeded by i) belongs to rank i % world_size; world_size 1 gives the whole state."""
    return {
        f"layers.{i}.weight": torch.randn(TENSOR_SHAPE, generator=torch.Generator().manual_seed(i))
        for i in range(tensor_count(gib))
        if i % world_size == rank
    }


class Holder(nn.Module):
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in state.items():
            self.register_buffer(name.replace(".", "_"), torch.empty_like(tensor))

    def remap(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {name.replace(".", "_"): tensor for name, tensor in state.items()}


def fsync_tree(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def clear(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def raw_write(path: Path, state: dict[str, torch.Tensor]) -> None:
    with path.open("wb") as handle:
        for tensor in state.values():
            handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
        handle.flush()
        os.fsync(handle.fileno())


def raw_read(path: Path, nbytes: int) -> None:
    buffer = bytearray(nbytes)
    with path.open("rb", buffering=0) as handle:
        handle.readinto(buffer)


# ---- two-rank runs (DCP and cx parallel writing) ---------------------------------------------------------------------
def two_rank_main(rank: int, world_size: int, gib: float, workdir: str, repeats: int, out: str) -> None:
    """DCP and cx parallel writing on 2 ranks, each rank holding half the tensors; interleaved repeats."""
    mine = make_state(gib, rank, world_size)
    target = {name: torch.empty_like(t) for name, t in mine.items()}
    root = Path(workdir)
    dcp_dir, cx_dir = root / "dcp", root / "cx2"

    def dcp_save() -> None:
        dcp_save_fn(mine, checkpoint_id=str(dcp_dir))
        if rank == 0:
            fsync_tree(dcp_dir)

    def cx_save() -> None:
        write_sharded(cx_dir, mine.items(), size_per_shard=1024, group=dist.group.WORLD)

    def cx_load() -> None:
        with CheckpointReader.open(cx_dir) as reader:
            for name in mine:
                target[name].copy_(reader.read(name))

    steps: list[tuple[str, Path, Callable[[], object], Callable[[], object]]] = [
        ("dcp", dcp_dir, dcp_save, lambda: dcp_load(target, checkpoint_id=str(dcp_dir))),
        ("cx2", cx_dir, cx_save, cx_load),
    ]
    times: dict[str, list[float]] = {}
    for _ in range(repeats):
        for label, path, save, load in steps:
            if rank == 0:
                clear(path)
            for phase, fn in (("save", save), ("load", load)):
                dist.barrier()
                start = time.perf_counter()
                fn()
                dist.barrier()
                times.setdefault(f"{label}_{phase}", []).append(time.perf_counter() - start)
            assert all(torch.equal(target[n], mine[n]) for n in mine)
            for tensor in target.values():
                tensor.zero_()
    if rank == 0:
        Path(out).write_text(json.dumps({key: statistics.median(values) for key, values in times.items()}))


def without_checksums(save: Callable[[], object]) -> Callable[[], object]:
    """`save` with the checksum computation switched off: the reference that shows what checksums cost."""

    def run() -> object:
        original = checksum_module.BackgroundCrc32.update
        checksum_module.BackgroundCrc32.update = lambda self, data: None  # type: ignore[method-assign]
        try:
            return save()
        finally:
            checksum_module.BackgroundCrc32.update = original  # type: ignore[method-assign]

    return run


def single_process_rows(state: dict[str, torch.Tensor], workdir: Path, repeats: int) -> list[tuple[str, float, float]]:
    """(label, median save s, median load s) for the raw disk and each single-process method.

    Methods are interleaved within each repeat (raw, torch, safetensors, cx, ...), so that slow phases of a shared
    disk's write-back hit all of them alike rather than whichever happened to run first.
    """
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    holder = Holder(state)
    holder.load_state_dict(holder.remap(state))
    io = GeneralCheckpointIO()
    raw, ts, st = workdir / "raw.bin", workdir / "torch.pt", workdir / "st.safetensors"
    single, sharded, sharded256 = workdir / "model.safetensors", workdir / "cx", workdir / "cx256"

    def torch_save() -> None:
        torch.save(state, ts)
        fsync_tree(ts)

    def safetensors_save() -> None:
        save_file(state, str(st))
        fsync_tree(st)

    methods: list[tuple[str, Path, Callable[[], object], Callable[[], object]]] = [
        (
            "raw disk (one write + fsync / one read into a new buffer)",
            raw,
            lambda: raw_write(raw, state),
            lambda: raw_read(raw, nbytes),
        ),
        (
            "torch.save / torch.load + load_state_dict",
            ts,
            torch_save,
            lambda: holder.load_state_dict(holder.remap(torch.load(ts, weights_only=True))),
        ),
        (
            "safetensors save_file / load_file + load_state_dict",
            st,
            safetensors_save,
            lambda: holder.load_state_dict(holder.remap(load_file(str(st)))),
        ),
        (
            "cx unsharded safetensors (save_model / load_model)",
            single,
            lambda: io.save_model(holder, single, use_safetensors=True),
            lambda: io.load_model(holder, single),
        ),
        (
            "cx sharded safetensors, 1024 MB shards (save_model / load_model)",
            sharded,
            lambda: io.save_model(holder, sharded, shard=True, use_safetensors=True),
            lambda: io.load_model(holder, sharded),
        ),
        (
            "cx unsharded safetensors, load_model(verify=True)",
            single,
            lambda: io.save_model(holder, single, use_safetensors=True),
            lambda: io.load_model(holder, single, verify=True),
        ),
        (
            "cx sharded safetensors, 1024 MB shards, load_model(verify=True)",
            sharded,
            lambda: io.save_model(holder, sharded, shard=True, use_safetensors=True),
            lambda: io.load_model(holder, sharded, verify=True),
        ),
        (
            "cx sharded safetensors, 1024 MB shards, checksums switched off (reference)",
            sharded,
            without_checksums(lambda: io.save_model(holder, sharded, shard=True, use_safetensors=True)),
            lambda: io.load_model(holder, sharded),
        ),
        (
            "cx sharded safetensors, 256 MB shards",
            sharded256,
            lambda: io.save_model(holder, sharded256, shard=True, use_safetensors=True, size_per_shard=256),
            lambda: io.load_model(holder, sharded256),
        ),
    ]
    saves: dict[str, list[float]] = {label: [] for label, *_ in methods}
    loads: dict[str, list[float]] = {label: [] for label, *_ in methods}
    for _ in range(repeats):
        for label, path, save, load in methods:
            clear(path)
            start = time.perf_counter()
            save()
            saves[label].append(time.perf_counter() - start)
            start = time.perf_counter()
            load()
            loads[label].append(time.perf_counter() - start)
            clear(path)
    return [(label, statistics.median(saves[label]), statistics.median(loads[label])) for label, *_ in methods]


def checksum_seconds(state: dict[str, torch.Tensor], repeats: int) -> float:
    """Median time of the CRC-32 a cx save computes over the state's bytes (its whole added cost on save)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        crc = 0
        for tensor in state.values():
            crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy().data, crc)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="working directory (default: a temporary one under /tmp)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="cx-bench-", dir=args.dir))
    try:
        state = make_state(args.gib)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        gb = nbytes / 1e9
        repeats = args.repeats
        rows = single_process_rows(state, workdir, repeats)
        crc_s = checksum_seconds(state, repeats)
        count = len(state)
        del state
        save_c = dict((label, s) for label, s, _ in rows)[
            "cx sharded safetensors, 1024 MB shards (save_model / load_model)"
        ]

        out = workdir / "two_rank.json"
        spawn(two_rank_main, 2, args.gib, str(workdir), repeats, str(out), timeout=600)
        two = json.loads(out.read_text())
        rows.append(
            ("torch.distributed.checkpoint, 2 ranks (dcp.save / dcp.load in place)", two["dcp_save"], two["dcp_load"])
        )
        rows.append(
            ("cx write_sharded, 2 ranks in parallel / CheckpointReader, 2 ranks", two["cx2_save"], two["cx2_load"])
        )

        print(f"state dict: {count} float32 tensors, {gb:.2f} GB; median of {repeats}; CPUs: {os.cpu_count()}")
        print("| method | save s | save GB/s | load s | load GB/s |")
        print("|---|---|---|---|---|")
        for label, save_s_, load_s_ in rows:
            load_text = f"{load_s_:.2f} | {gb / load_s_:.2f}" if load_s_ else "- | -"
            print(f"| {label} | {save_s_:.2f} | {gb / save_s_:.2f} | {load_text} |")
        by = {label: (s, lo) for label, s, lo in rows}
        cx_save, cx_load = by["cx unsharded safetensors (save_model / load_model)"]
        st_save, st_load = by["safetensors save_file / load_file + load_state_dict"]
        dcp_save_s, dcp_load_s = two["dcp_save"], two["dcp_load"]
        print()
        print(f"cx unsharded save / safetensors save: {cx_save / st_save:.2f}x time (goal <= 1.2x)")
        print(f"cx sharded save / safetensors save: {save_c / st_save:.2f}x time")
        print(f"cx unsharded save / DCP 2-rank save: {cx_save / dcp_save_s:.2f}x time (goal <= 1.0x)")
        print(f"cx 2-rank save / DCP 2-rank save: {two['cx2_save'] / dcp_save_s:.2f}x time")
        print(f"cx unsharded load / safetensors load: {cx_load / st_load:.2f}x time (goal <= 1.0x)")
        print(f"cx unsharded load / DCP 2-rank load: {cx_load / dcp_load_s:.2f}x time (goal <= 1.0x)")
        print(f"cx 2-rank load / DCP 2-rank load: {two['cx2_load'] / dcp_load_s:.2f}x time")
        _, sharded_load = by["cx sharded safetensors, 1024 MB shards (save_model / load_model)"]
        _, verified_single = by["cx unsharded safetensors, load_model(verify=True)"]
        _, verified_sharded = by["cx sharded safetensors, 1024 MB shards, load_model(verify=True)"]
        unchecked_save, _ = by["cx sharded safetensors, 1024 MB shards, checksums switched off (reference)"]
        print(f"cx sharded save with checksums / without: {save_c / unchecked_save:.2f}x time")
        print(f"CRC-32 of the state: {crc_s:.3f} s ({gb / crc_s:.2f} GB/s) = {crc_s / cx_save:.2f} of the cx save time")
        print(f"cx unsharded load verify=True / plain: {verified_single / cx_load:.2f}x time")
        print(f"cx sharded load verify=True / plain: {verified_sharded / sharded_load:.2f}x time")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
