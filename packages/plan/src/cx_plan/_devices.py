"""The hardware the planner predicts for: accelerators (peak dense FLOP/s per precision, memory) and links
(bandwidth per direction, latency), each overridable, with the published source of every figure.

Peaks are the vendors' datasheet dense figures (no structured sparsity); fp32 is the non-tensor-core figure, as
PyTorch runs fp32 matmuls without TF32 by default. Link bandwidths are per direction, the number a ring collective
is bounded by. The `cpu` and `loopback` rows are this repository's CPU machines (2 cores, gloo over loopback):
measured figures (benchmarks/plan/bench_step_time.py re-measures the FLOP rates, benchmarks/plan/calibrate_cpu.py the
per-op, per-tensor and per-collective costs), not datasheet ones.

Host costs, which a tiny model's step is made of: `op_s`, the time eager PyTorch takes to dispatch one aten op;
`optimizer_tensor_s`, torch AdamW's per-parameter-tensor loop; `cores`, the cores the ranks of one machine share (0:
each rank has its own accelerator). On a GPU the host dispatches asynchronously, so its op time hides under the kernels
unless it is longer than they are; on the CPU it adds, and more ranks than cores share them (world / cores slower).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field

__all__ = [
    "ACHIEVABLE_FRACTION",
    "DEVICES",
    "LINKS",
    "Device",
    "Link",
    "Network",
    "default_network",
    "fewest_ranks_per_node",
    "lookup_device",
    "lookup_link",
    "memory_per_rank",
    "parse_memory",
    "parse_reserve",
]

_GB = 10**9
_MIB = 2**20
# What the devices report (torch.cuda.get_device_properties(0).total_memory, nvidia-smi's "MiB" column), not the
# marketing figure: an H100 80GB shows 81,559 MiB (85.5 x 10^9 bytes), an H200 143,771 MiB, an A100 80GB 81,920 MiB.
_H100_BYTES = 81_559 * _MIB
_H200_BYTES = 143_771 * _MIB
_A100_BYTES = 81_920 * _MIB
# torchtitan's H100s have 96 GB of HBM2e (6 stacks of 16 GiB); what they report is not published: taken as the SXM's
# share of its raw 80 GiB (81,559 of 81,920 MiB) of the raw 96 GiB
_H100_96GB_BYTES = 97_871 * _MIB
RESERVE_FRACTION = 0.1  # held back by default: CUDA context, NCCL and library workspaces, allocator fragmentation
# The fraction of the peak a step's compute reaches where a device row fits none of its own (h100, h200, cpu): 45 %,
# between the 33 % to 39 % MFU torchtitan measured for Llama 3.1 8B on its 500 W H100s and the 52 % of Megatron-LM's
# largest GPT runs on A100. The rows fitted to a published run (a100, h100_96gb) carry theirs (`Device.efficiency`).
ACHIEVABLE_FRACTION = 0.45


@dataclass(frozen=True)
class Device:
    """One accelerator: peak dense FLOP/s by precision ("bf16", "fp16", "fp32"; "fp8" where it has fp8 GEMMs), memory
    in bytes and memory bandwidth in bytes/s (what bounds the optimizer step)."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: int
    memory_bandwidth: float
    source: str
    op_s: float = 0.0  # host seconds per dispatched aten op
    optimizer_tensor_s: float = 0.0  # host seconds per parameter tensor of one AdamW step (beyond its bytes)
    cores: int = 0  # cores the ranks of one machine share (0: a device per rank, asynchronous dispatch)
    # measured host seconds of a plugin's own work per parameter tensor and step (one rank, more ranks) by
    # `_host_time.plugin_key`; "torch_fsdp block" per FSDP unit and micro-batch. Absent: counted ops x op_s.
    plugin_tensor_s: dict[str, tuple[float, float]] = field(default_factory=dict)
    reserve: float = RESERVE_FRACTION  # fraction of `memory_bytes` the planner keeps free; a peak inside it is "tight"
    # the fraction of `peak_flops` the forward and backward reach (cx-plan's --efficiency overrides it); fitted to
    # one published run where the row says so, else ACHIEVABLE_FRACTION
    efficiency: float = ACHIEVABLE_FRACTION

    @property
    def usable_bytes(self) -> int:
        """Memory a layout may take and still count as fitting comfortably (the rest is the reserve)."""
        return int(self.memory_bytes * (1.0 - self.reserve))

    @property
    def host_bound(self) -> bool:
        """Whether host work adds to the step (a CPU) rather than overlapping the device's kernels (a GPU)."""
        return self.cores > 0

    def oversubscription(self, world_size: int) -> float:
        """How much slower each rank's host work runs with `world_size` ranks on this machine's cores."""
        return max(1.0, world_size / self.cores) if self.cores else 1.0

    def peak(self, precision: str) -> float:
        """The peak for `precision` (a ValueError naming the known ones otherwise)."""
        if precision not in self.peak_flops:
            raise ValueError(
                f"device {self.name}: no peak for precision {precision!r}; known: {sorted(self.peak_flops)}"
            )
        return self.peak_flops[precision]


@dataclass(frozen=True)
class Link:
    """One interconnect: bytes per second per direction and the latency of one message in seconds."""

    name: str
    bandwidth: float
    latency: float
    source: str


@dataclass(frozen=True)
class Network:
    """The links a collective may cross: `intra` inside a node of `devices_per_node` ranks, `inter` between nodes
    (ranks are numbered node by node, as torchrun does)."""

    intra: Link
    inter: Link
    devices_per_node: int

    def link_for(self, span: int) -> Link:
        """The slowest link a group crosses whose ranks lie within `span` consecutive global ranks."""
        return self.intra if span <= self.devices_per_node else self.inter

    def ring_bandwidth(self, axes: tuple[tuple[int, int], ...], world: int) -> float:
        """Bytes/s per rank of a ring collective (all-reduce, all-gather, reduce-scatter) over the groups of the
        layout axes `axes` ((size, stride) each, ranks row-major) among `world` ranks. A group inside one node: the
        intra link. Across nodes NCCL runs one ring per channel and spreads the channels over the NICs of the
        group's ranks on a node: each ring enters and leaves every node once, so a node's share of one rank's ring
        volume crosses the inter links of the group's ranks there together (one NIC per GPU), bounded by the intra
        link the ring also passes (nccl-tests' bus bandwidth across DGX / HGX nodes: about the node's summed NIC
        rate, not one NIC's). The node holding the fewest of a group's ranks bounds its ring, and the slowest group
        the step (`fewest_ranks_per_node`)."""
        fewest = fewest_ranks_per_node(axes, world, self.devices_per_node)
        if fewest is None:
            return self.intra.bandwidth
        return min(self.intra.bandwidth, self.inter.bandwidth * fewest)


@functools.lru_cache(maxsize=4096)
def fewest_ranks_per_node(axes: tuple[tuple[int, int], ...], world: int, devices_per_node: int) -> int | None:
    """Over every group along `axes` ((size, stride) each) among `world` ranks numbered node by node: the fewest of
    a group's ranks on one node it touches, among the groups spanning several nodes (None: every group lies in one
    node). Counted rank by rank, since groups whose ranks sit unevenly on the nodes (dp 9 on 8-GPU nodes: 8 and 1;
    dp 3 beside tp 4: 2 and 1; dp x sp with pp ranks in between) are bounded by the node with the fewest."""
    counts: dict[int, collections.Counter[int]] = {}
    for rank in range(world):
        group = rank - sum((rank // stride % size) * stride for size, stride in axes)  # the group's first rank
        counts.setdefault(group, collections.Counter())[rank // devices_per_node] += 1
    crossing = [min(per_node.values()) for per_node in counts.values() if len(per_node) > 1]
    return min(crossing) if crossing else None


_NVIDIA_H100 = (
    "NVIDIA H100 Tensor Core GPU datasheet (SXM5): bf16/fp16 989 TFLOP/s dense, fp8 1,979, fp32 67 TFLOP/s, "
    "80 GB HBM3 at 3.35 TB/s; memory as the device reports it: 81,559 MiB"
)
_NVIDIA_H200 = (
    "NVIDIA H200 Tensor Core GPU datasheet (SXM): H100 compute (fp8 1,979 TFLOP/s dense), 141 GB HBM3e at 4.8 TB/s; "
    "memory as the device reports it: 143,771 MiB"
)
_H100_96GB = (
    "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Meta's Grand Teton hosts): H100 with 96 GB HBM2e at "
    "2.4 TB/s, the default 500 W power limit (the SXM's TDP is 700 W), 8 per host on NVLink, 400 Gb/s RDMA per GPU; "
    "its peak 'should be between SXM and NVL, and we don't know the exact value' (torchtitan's footnote): taken as "
    "the midpoint of the SXM's and the NVL's (NVIDIA H100 datasheet, dense): bf16 989 and 835 TFLOP/s, 912; fp32 67 "
    "and 60, 63.5; fp8 twice bf16"
)
_NVIDIA_A100 = (
    "NVIDIA A100 Tensor Core GPU datasheet (SXM 80GB): bf16/fp16 312 TFLOP/s dense, fp32 19.5 TFLOP/s, 80 GB HBM2e at "
    "2.04 TB/s; memory as the device reports it: 81,920 MiB"
)
_CPU = (
    "measured here: torch.matmul 512x512 on one thread of the 2-core Xeon dev machine (AMX): fp32 95, bf16 390, "
    "fp16 58 GFLOP/s; a one-thread in-place add of 64 MB streams 7.6 GB/s; 8 GB assumed (pass --device-memory); "
    "calibrate_cpu.py on one process (2026-12-02): 12.1 us per aten op of a hidden-32 GPT's forward and backward "
    "(440 ops), 65 us per tensor of a torch AdamW step over 256 small tensors; 4 processes on the 2 cores: 2.3x the "
    "per-op time; each plugin's step on a hidden-32, 4-layer GPT (52 tensors) against hybrid ZeRO 0's, in turns"
)
# calibrate_cpu.calibrate_plugins (2026-12-02), seconds per parameter tensor and step beyond the model and AdamW, on
# one rank / two ranks (the two-rank run under a load of ~3 on the 2 cores, scaled by 0.6, the ratio of hybrid ZeRO
# 0's step between a quiet and that run; ZeRO 0 itself on two ranks: its 4 counted ops a tensor, 48 us):
# DDP +0.72 ms / 52 tensors; FSDP2 (DTensor parameters: AdamW's ops go through DTensor dispatch) +14.6 ms; per-block
# FSDP +7.4 ms more over 4 blocks; LowLevelZero 1 / 2 +1.8 / +0.8 ms; Gemini +7.3 ms.
_CPU_PLUGINS = {
    "torch_ddp": (14e-6, 19e-6),
    "torch_fsdp": (280e-6, 470e-6),
    "torch_fsdp block": (1.85e-3, 4.2e-3),
    "zero": (25e-6, 135e-6),
    "gemini": (140e-6, 300e-6),
    "zero0": (0.0, 48e-6),
}
# Eager PyTorch launches each CUDA kernel from the host in ~5-10 us (the brief of issue 26; not measured here); it
# overlaps the kernels, so it only shows when a step's kernels are shorter. AdamW on CUDA is foreach / fused: no
# per-tensor loop.
_GPU_OP_S = 5e-6
# "fp8": the linear layers' matmuls under --fp8 (`step_time._kernels`); a device without the key has no fp8 GEMMs
_HOPPER_PEAKS = {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12, "fp8": 1979e12}

# Fitted, each to one published run (benchmarks/plan/published_tps.py solves them; RESULTS.md, "Tokens per second
# per GPU"): the fraction of the row's bf16 peak at which cx-plan's step reproduces the run's tokens/s per GPU.
# a100: torchtitan docs/performance.md, Llama 3 8B on 64 A100 80 GB, FSDP2, local batch 1, selective op checkpointing,
# 2,973 tokens/s per GPU. h100_96gb: torchtitan llama3_h100_202412 Table 1, Llama 3.1 8B on 8 of those H100s, FSDP2,
# local batch 2, selective op, eager, 5,762. The A100 reaches more of its peak than the H100: it has 153 FLOPs per
# byte of memory bandwidth (312 TFLOP/s, 2.04 TB/s) against the H100 SXM's 295 and this part's 380, so the step's
# memory-bound kernels (norms, rotary, SwiGLU's products, casts, FSDP's copies) weigh less beside its matmuls.
_A100_EFFICIENCY = 0.60
_H100_96GB_EFFICIENCY = 0.40

DEVICES: dict[str, Device] = {
    "h100": Device("h100", dict(_HOPPER_PEAKS), _H100_BYTES, 3.35e12, _NVIDIA_H100, op_s=_GPU_OP_S),
    "h200": Device("h200", dict(_HOPPER_PEAKS), _H200_BYTES, 4.8e12, _NVIDIA_H200, op_s=_GPU_OP_S),
    "a100": Device(
        "a100",
        {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
        _A100_BYTES,
        2.04e12,
        _NVIDIA_A100,
        op_s=_GPU_OP_S,
        efficiency=_A100_EFFICIENCY,
    ),
    "h100_96gb": Device(
        "h100_96gb",
        {"bf16": 912e12, "fp16": 912e12, "fp32": 63.5e12, "fp8": 1824e12},
        _H100_96GB_BYTES,
        2.4e12,
        _H100_96GB,
        op_s=_GPU_OP_S,
        efficiency=_H100_96GB_EFFICIENCY,
    ),
    "cpu": Device(
        "cpu",
        {"bf16": 390e9, "fp16": 58e9, "fp32": 95e9},
        8 * _GB,
        7.6e9,
        _CPU,
        op_s=12.1e-6,
        optimizer_tensor_s=65e-6,
        cores=2,
        plugin_tensor_s=_CPU_PLUGINS,
    ),
}

LINKS: dict[str, Link] = {
    # NVLink 4 (H100/H200 SXM): 900 GB/s total = 450 GB/s per direction (NVIDIA H100 datasheet); NCCL's small-message
    # latency inside a node is a few microseconds (NCCL tests).
    "nvlink4": Link("nvlink4", 450e9, 3e-6, "NVIDIA H100 datasheet: NVLink 900 GB/s bidirectional"),
    # NVLink 3 (A100 SXM): 600 GB/s total = 300 GB/s per direction (NVIDIA A100 datasheet).
    "nvlink3": Link("nvlink3", 300e9, 3e-6, "NVIDIA A100 datasheet: NVLink 600 GB/s bidirectional"),
    # InfiniBand NDR 400 Gb/s per GPU (one ConnectX-7 per GPU, as in DGX H100) = 50 GB/s per direction.
    "ib_ndr": Link("ib_ndr", 50e9, 10e-6, "NVIDIA ConnectX-7 datasheet: InfiniBand NDR 400 Gb/s per port"),
    # InfiniBand HDR 200 Gb/s per GPU (DGX A100) = 25 GB/s per direction.
    "ib_hdr": Link("ib_hdr", 25e9, 10e-6, "NVIDIA ConnectX-6 datasheet: InfiniBand HDR 200 Gb/s per port"),
    # PCIe Gen5 x16: 64 GB/s per direction; Gen4 x16: 32 GB/s (PCI-SIG specifications).
    "pcie5": Link("pcie5", 64e9, 5e-6, "PCI-SIG PCIe 5.0: 32 GT/s x16"),
    "pcie4": Link("pcie4", 32e9, 5e-6, "PCI-SIG PCIe 4.0: 16 GT/s x16"),
    # gloo over loopback on the 2-core dev machine (calibrate_cpu.py, 2 processes, 2026-12-02): a 16 MiB all-reduce
    # ran at 0.63 GB/s bus bandwidth; a 4-byte all_reduce (2 hops) took 0.21 ms, all_gather_into_tensor 0.24,
    # reduce_scatter_tensor 0.30, all_to_all_single 0.17 (1 hop each): 0.2 ms a hop on average. On 4 processes (2 per
    # core) the per-hop time doubled or more, which `Device.oversubscription` scales it by.
    "loopback": Link(
        "loopback", 0.63e9, 0.2e-3, "measured here: gloo collectives between 2 processes on loopback (calibrate_cpu.py)"
    ),
}

_DEFAULT_NETWORK = {
    "h100": ("nvlink4", "ib_ndr", 8),
    "h200": ("nvlink4", "ib_ndr", 8),
    "a100": ("nvlink3", "ib_hdr", 8),
    "h100_96gb": ("nvlink4", "ib_ndr", 8),
    "cpu": ("loopback", "loopback", 1 << 30),
}


def lookup_device(
    name: str, memory_bytes: int | None = None, peak_flops: float | None = None, reserve: float | None = None
) -> Device:
    """The table's device `name` (case-insensitive), with its memory, peak (every precision; fp8 keeps its ratio to
    bf16) and/or reserve (the fraction of its memory held back) overridden."""
    found = DEVICES.get(name.lower())
    if found is None:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(sorted(DEVICES))}")
    if reserve is not None:
        if not 0.0 <= reserve < 1.0:
            raise ValueError(f"the reserve must be a fraction of the memory in [0, 1), got {reserve}")
        found = dataclasses.replace(found, reserve=reserve)
    if memory_bytes is not None:
        if memory_bytes <= 0:
            raise ValueError(f"device memory must be positive, got {memory_bytes} bytes")
        found = dataclasses.replace(found, memory_bytes=memory_bytes, source=found.source + "; memory overridden")
    if peak_flops is not None:
        if not peak_flops > 0:
            raise ValueError(f"peak FLOP/s must be positive, got {peak_flops}")
        peaks = dict.fromkeys(found.peak_flops, peak_flops)
        if "fp8" in peaks:  # twice the 16-bit rate on the table's devices, whatever the override
            peaks["fp8"] = peak_flops * found.peak_flops["fp8"] / found.peak_flops["bf16"]
        found = dataclasses.replace(found, peak_flops=peaks, source=found.source + "; peak overridden")
    return found


def lookup_link(name: str, bandwidth: float | None = None, latency: float | None = None) -> Link:
    """The table's link `name`, with its bandwidth (bytes/s per direction) and/or latency (s) overridden."""
    found = LINKS.get(name.lower())
    if found is None:
        raise ValueError(f"unknown interconnect {name!r}; known: {', '.join(sorted(LINKS))}")
    if bandwidth is not None:
        if not bandwidth > 0:
            raise ValueError(f"link bandwidth must be positive, got {bandwidth}")
        found = dataclasses.replace(found, bandwidth=bandwidth, source=found.source + "; bandwidth overridden")
    if latency is not None:
        if not latency >= 0:
            raise ValueError(f"link latency must be >= 0, got {latency}")
        found = dataclasses.replace(found, latency=latency, source=found.source + "; latency overridden")
    return found


def default_network(device: Device) -> Network:
    """The usual links of a device's servers: NVLink inside an 8-GPU node and InfiniBand between nodes; the CPU
    machine is one node on loopback."""
    intra, inter, per_node = _DEFAULT_NETWORK.get(device.name, ("loopback", "loopback", 1 << 30))
    return Network(LINKS[intra], LINKS[inter], per_node)


_MEMORY = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_reserve(text: str, memory_bytes: int) -> float:
    """The reserve as a fraction of `memory_bytes`: `10%`, `0.1` or a size (`6GiB`, `4GB`)."""
    stripped = text.strip()
    try:
        value = float(stripped[:-1]) / 100 if stripped.endswith("%") else float(stripped)
    except ValueError:
        value = parse_memory(stripped) / memory_bytes
    if not 0.0 <= value < 1.0:
        raise ValueError(f"--reserve {text!r} is not below the device's memory (a fraction in [0, 1), a % or a size)")
    return value


def parse_memory(text: str) -> int:
    """Bytes from `80GB`, `80G`, `141 GB`, `64GiB`, `512MiB` or a plain byte count (GB = 10^9, GiB = 2^30)."""
    match = _MEMORY.match(text)
    if match is None:
        raise ValueError(f"cannot read the memory size {text!r}: expected a number and a unit, e.g. 80GB or 64GiB")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    binary = "i" in unit
    letter = unit[:1] if unit not in ("b", "") else ""
    scale = 2 ** (10 * "kmgt".index(letter) + 10) if binary else _UNITS[letter]
    value = int(number * scale)
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return value


_CUDA_NAMES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))  # substrings of torch.cuda.get_device_name


def detect_device() -> Device:
    """This machine's device as the table knows it: the first CUDA device's row when its name matches one (H200,
    H100, A100), with its real memory; otherwise the CPU row with this host's physical memory (which every rank
    shares: `memory_per_rank`)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        for key, row in _CUDA_NAMES:
            if key in name:
                return lookup_device(row, memory_bytes=torch.cuda.get_device_properties(0).total_memory)
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: the table's assumption
        return DEVICES["cpu"]
    return lookup_device("cpu", memory_bytes=host)


def memory_per_rank(device: Device, ranks_here: int) -> int:
    """Memory one rank may use: a GPU's own, or on the CPU the host's shared by the ranks running on it."""
    return device.memory_bytes // ranks_here if device.name == "cpu" else device.memory_bytes
