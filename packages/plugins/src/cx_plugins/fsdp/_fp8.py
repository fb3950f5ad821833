"""TorchFSDPPlugin's fp8 switches on FSDP2.

`use_fp8`: the `nn.Linear` layers `cx_mesh.fp8.fp8_eligible` accepts (output layer excluded, `Fp8Options`) compute
in fp8 with dynamic tensorwise scales (E4M3 forward operands, E5M2 gradients, master weights untouched), swapped in
before sharding with their parameter names unchanged. On CUDA they become torchao's Float8Linear
(`convert_to_float8_training`, the optional `fp8` extra, imported only then): its float8 weights compose with FSDP2's
DTensor sharding and all-gather, as torchtitan trains. On CPU they become `cx_mesh.fp8.Fp8Linear`: torchao's
tensorwise GEMM hands torch's CPU `_scaled_mm` scalar scales, its slow path (a tiny Llama step took 2.0 s against
0.09 s with Fp8Linear; one 256^3 forward 13 s against 10 ms, benchmarks/fp8/RESULTS.md), so there torchao is unusable.

`fp8_communication`: FSDP2's own comm hooks (`set_custom_reduce_scatter` / `set_custom_all_gather`, one pair per
sharded module) send the gradient reduce-scatter through `cx_mesh.fp8.reduce_scatter_flat_fp8` (E5M2, float32 sums)
and the parameter all-gather through `all_gather_flat_fp8` (E4M3, one scale per rank's shard). With torchao's
Float8Linear, its weights travel as torchao's float8 all-gather instead (the fp8 bytes the matmul consumes, no second
rounding); FSDP2 then packs a module's shards as raw bytes (uint8) beside its other parameters, which cannot be
quantized again, so those (norm weights beside fp8 linears) travel in their own dtype.

The hooks keep FSDP2's contract (torch 2.13, `_fsdp_api.py` / `_fsdp_collectives.py`): with async_op they return a
Work (cx_mesh.fp8's, whose `wait` finishes the dequantize) and FSDP2 waits on it before the copy-out, so an
explicitly prefetched `unshard(async_op=True)` overlaps the exchange with compute; without it they finish on the
stream FSDP2 runs them on (its all-gather / reduce-scatter stream, overlapped by events) and return None, since
FSDP2 takes any returned Work to mean an async all-gather and then frees the forward's gathered buffer early.
FSDP2 calls the reduce-scatter without async_op and ignores what it returns.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# FSDP2's comm-hook interfaces: public through FSDPModule.set_custom_*, not re-exported by torch.distributed.fsdp
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from cx_mesh import get_accelerator
from cx_mesh.fp8 import (
    E4M3,
    E5M2,
    Fp8Options,
    ScalingRecipe,
    all_gather_flat_fp8,
    fp8_eligible,
    fp8_matmul_supported,
    reduce_scatter_flat_fp8,
)
from cx_plugins.fp8._use_fp8 import convert_linears_to_fp8, warn_nothing_converted

__all__ = [
    "Fp8AllGather",
    "Fp8ReduceScatter",
    "convert_linears",
    "convert_to_float8",
    "fp8_linears_for_device",
    "require_torchao",
    "use_fp8_collectives",
]

TORCHAO, CX_MESH = "torchao", "cx_mesh"

_EXTRA_HINT = "install the fp8 extra: pip install 'cx-plugins[fp8]' (torchao>=0.18)"


def require_torchao() -> Any:
    """torchao.float8, or an ImportError naming the extra (checked when the plugin is built, not at the first step)."""
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as error:
        raise ImportError(
            f"TorchFSDPPlugin(use_fp8=True) on CUDA trains with torchao's float8 linears; {_EXTRA_HINT}"
        ) from error


_OPTIONS = Fp8Options()  # the size filter and the excluded output layer, as every plugin's use_fp8


def convert_to_float8(module: nn.Module, float8_all_gather: bool, options: Fp8Options = _OPTIONS) -> list[str]:
    """Swap, in place, the eligible `nn.Linear` submodules for torchao's Float8Linear (parameter names unchanged);
    `float8_all_gather` makes FSDP2 all-gather their weights in fp8. Returns the converted names."""
    float8 = require_torchao()
    converted: list[str] = []

    def eligible(child: nn.Module, name: str) -> bool:
        ok = (
            type(child) is nn.Linear
            and fp8_eligible(child.in_features, child.out_features, options)
            and not options.excludes(name)
        )
        if ok:
            converted.append(name)
        return ok

    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    float8.convert_to_float8_training(module, module_filter_fn=eligible, config=config)
    return converted


def fp8_linears_for_device() -> str:
    """Which fp8 linears `use_fp8` uses on this accelerator: torchao's on CUDA, cx_mesh.fp8's elsewhere (see above)."""
    return TORCHAO if get_accelerator().name == "cuda" else CX_MESH


def convert_linears(
    module: nn.Module, linears: str, float8_all_gather: bool, recipe: ScalingRecipe = ScalingRecipe.TENSORWISE
) -> list[str]:
    """Swap the eligible linears of `module` for `linears`' fp8 ones (TORCHAO or CX_MESH, the latter scaled as
    `recipe` says; FSDPOptions refuses another recipe than TENSORWISE for torchao's); returns their names. As every
    plugin's use_fp8 (cx_plugins.fp8._use_fp8): a device without fp8 GEMMs is a ValueError at boost, and a model with
    nothing converted a warning naming the switch."""
    if linears == CX_MESH:
        return convert_linears_to_fp8(module, "TorchFSDPPlugin", Fp8Options(recipe=recipe))
    if linears != TORCHAO:
        raise ValueError(f"TorchFSDPPlugin(use_fp8=True): unknown fp8 linears {linears!r}; {TORCHAO!r} or {CX_MESH!r}")
    device = get_accelerator().current_device()
    if not fp8_matmul_supported(device):
        raise ValueError(
            f"TorchFSDPPlugin(use_fp8=True): fp8 matmuls do not run on {device} (a CUDA GPU of compute capability "
            "8.9 or newer); pass use_fp8=False"
        )
    converted = convert_to_float8(module, float8_all_gather)
    if not converted:
        warn_nothing_converted("TorchFSDPPlugin", stacklevel=3)
    return converted


class Fp8AllGather(AllGather):
    """FSDP2's parameter all-gather with an E4M3 payload and one float32 scale per rank; a buffer FSDP2 packed as
    raw bytes (torchao's fp8 weights beside other parameters) is already as small as it gets and goes as it is."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if not input_tensor.is_floating_point() or input_tensor.element_size() == 1:
            work: dist.Work | None = dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
            return work
        return all_gather_flat_fp8(output_tensor, input_tensor, group=group, async_op=async_op, fp8_dtype=E4M3)


class Fp8ReduceScatter(ReduceScatter):
    """FSDP2's gradient reduce-scatter (SUM or AVG, as FSDP2 asks) with E5M2 slices summed in float32."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        return reduce_scatter_flat_fp8(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op, fp8_dtype=E5M2
        )


def use_fp8_collectives(modules: list[nn.Module]) -> None:
    """Give each sharded module the fp8 all-gather and reduce-scatter."""
    for module in modules:
        assert isinstance(module, FSDPModule), "called on the modules fully_shard returned"
        module.set_custom_all_gather(Fp8AllGather())
        module.set_custom_reduce_scatter(Fp8ReduceScatter())
