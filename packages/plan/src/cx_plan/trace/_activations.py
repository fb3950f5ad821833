"""The activation figure: one micro-batch's forward and backward of one pipeline stage of the real model, under the
real shard policy, traced with FakeTensors (nothing is allocated, so 8B-class shapes trace in seconds).

The trace runs in this process: torch.distributed is initialised with the "fake" backend for the candidate's world
size and the rank of the stage traced, the plugin of the candidate is constructed (its layout, ShardConfig and
pipeline stage manager), and the hybrid plugins' own composition (`compose_model`: ShardFormer, pipeline split) cuts
the model, built on the meta device; the stage's parameters become FakeTensors, and `MemTracker` follows every live
tensor through the forward and backward. Data-dependent reads go to `ValueOracle` (MoE routing balanced, or skewed
towards the traced ep rank). The data-parallel plugins (DDP, FSDP, LowLevelZero, Gemini) do not change what a rank
computes: their trace is the whole model's (Gemini at tp > 1: a tp rank's, split by ShardFormer as under
HybridParallelPlugin). Activation checkpointing follows the candidate: ShardFormer's ratio under the hybrid plugins,
transformers' own switch (every layer) under the others.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from dataclasses import astuple, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from cx_mesh import ProcessGroupMesh
from cx_plan._candidate import Candidate
from cx_plan.trace._model_spec import ModelShape, build_model
from cx_plan.trace._oracle import Routing, ValueOracle, hot_rank_load
from cx_plugins import Axis, enable_activation_checkpointing
from cx_plugins.hybrid import HybridParallelPlugin, compose_model
from cx_plugins.models import GPTConfig
from cx_plugins.moe_hybrid import MoeHybridParallelPlugin
from cx_shardformer import GradientCheckpointConfig

__all__ = [
    "ActivationTrace", "LayerSlope", "PlanTraceError", "forward_op_flops", "layer_slope", "shallow_layers",
    "stage_rank", "tp_rank_model", "trace_shallow", "trace_stage",
]  # fmt: skip

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_CPU = torch.device("cpu")
_ACTIVATION_KINDS = ("ACT", "TEMP", "OTH", "INP")
_TOTAL = "Total"  # MemTracker's key of a device's total bytes in its snapshots
_EXACT_LAYERS = 4  # decoder layers per stage traced as they are; deeper stages are extrapolated (trace_stage)
# `tensor.device` on a FakeTensor: dispatched through every mode like an op (the autograd engine asks it of each
# gradient), it was 60 % of a Mixtral layer's dispatches; no bytes, values or FLOPs, so each mode passes it straight on
_DEVICE_QUERY = torch.ops.prim.device.default


_ATTENTION = (
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_attention_math.default,
)


_MATMUL_OPERANDS = {  # a forward matrix multiply: which two arguments are multiplied
    torch.ops.aten.mm.default: (0, 1),
    torch.ops.aten.addmm.default: (1, 2),
    torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.baddbmm.default: (1, 2),
    torch.ops.aten._grouped_mm.default: (0, 1),  # the routed experts' tokens, group by group
}


def forward_op_flops(func: Any, args: Any) -> int:
    """FLOPs of a forward matrix multiply (mm, addmm, bmm, baddbmm, the experts' grouped mm) or attention kernel
    (QK^T and PV: 4 b h s_q s_k d, no causal halving, as `flops_per_token` counts it); 0 for any other op."""
    operands = _MATMUL_OPERANDS.get(func)
    if operands is not None:
        a: torch.Tensor = args[operands[0]]
        b: torch.Tensor = args[operands[1]]
        return 2 * int(a.shape[:-1].numel()) * int(a.shape[-1]) * int(b.shape[-1])
    if func in _ATTENTION:
        query: torch.Tensor = args[0]
        key: torch.Tensor = args[1]
        return 4 * int(query.shape[:-1].numel()) * int(key.shape[-2]) * int(query.shape[-1])
    return 0


class _OpCount:
    """Counts the aten ops dispatched (collectives, in other namespaces, are timed from `_comm_volume`); `forward`
    holds the count when the forward ended. It also adds up the forward's matmul and attention FLOPs and those the
    backward recomputes: activation checkpointing reruns a layer's forward with grad enabled (the backward's own
    kernels run with it disabled), and the selective op policy serves the outputs it saved without running them, so
    `recompute_flops` is what the chosen checkpointing really recomputes. Fed by `_PeakTracker`, the top dispatch
    mode, which sees every op the traced code dispatches (a mode of its own cost a Python layer per op)."""

    def __init__(self) -> None:
        self.count = self.forward = 0
        self.forward_flops = self.recompute_flops = 0
        self.backward_started = False

    def see(self, func: Any, args: Any) -> None:
        self.count += func.namespace == "aten"
        flops = forward_op_flops(func, args)
        if flops and not self.backward_started:
            self.forward_flops += flops
        elif flops and torch.is_grad_enabled():
            self.recompute_flops += flops


class _PeakTracker(MemTracker):
    """torch's `MemTracker` keeping only the totals the planner reads (the current and the peak snapshot): after
    every op MemTracker also walks every tracked module to update its per-module peaks, which the planner never
    reads; that walk was a quarter of an 8B search's time. A device query allocates nothing: the top mode of the
    trace, it answers a FakeTensor's as FakeTensorMode would (its `fake_device`), without passing it down through
    the modes below (60 % of a trace's dispatches went down three more Python layers for it). Every other op is
    counted in `ops` first."""

    def __init__(self, ops: _OpCount) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _DEVICE_QUERY:
            tensor = args[0] if len(args) == 1 else None
            if isinstance(tensor, FakeTensor) and not tensor.fake_mode.in_kernel_invocation:
                return tensor.fake_device
            return func(*args, **(kwargs or {}))
        self.ops.see(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL]:
                self._peak_mem[device] = snapshot[_TOTAL]
                self._peak_mem_snap[device] = dict(snapshot)


class PlanTraceError(RuntimeError):
    """The trace cannot run here (e.g. torch.distributed is already initialised in this process)."""


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes one rank of one stage holds while it runs one micro-batch forward and backward (from the trace)."""

    stage: int
    parameter_bytes: int  # the stage's parameters and buffers, at the compute precision
    activation_bytes: int  # activations and temporaries at the trace's peak
    gradient_bytes: int  # parameter gradients live at the trace's peak
    gradient_total_bytes: int  # all the stage's gradients (at the end of the backward)
    peak_bytes: int  # everything at the peak: parameters + gradients + activations
    saved_bytes: int  # activations the forward leaves for the backward (what a pipeline keeps per micro-batch)
    parameter_count: int  # elements of the parameters the stage trains
    expert_parameter_count: int = 0  # of which routed experts' (reduced over moe_dp, not dp)
    forward_ops: int = 0  # aten ops the micro-batch's forward dispatches (what a step's dispatch cost counts)
    backward_ops: int = 0  # and its backward (recomputed forwards included)
    parameter_tensors: int = 0  # the trained parameter tensors (what per-tensor optimizer and plugin work counts)
    forward_flops: int = 0  # matmul and attention FLOPs of the micro-batch's forward
    recompute_flops: int = 0  # of those, what activation checkpointing runs again in the backward

    @property
    def working_bytes(self) -> int:
        """What the micro-batch's step adds above the parameters at its peak."""
        return self.activation_bytes + self.gradient_bytes


def stage_rank(candidate: Candidate, stage: int) -> int:
    """A global rank in pipeline stage `stage`: the rank at pp coordinate `stage` (0 on every other axis) of the
    layout the candidate's plugin builds, so the mesh order is the plugin's own (MoeHybrid's (moe_dp, pp, ep, tp, sp)
    puts ep inside pp, which a stride of tp x sp missed)."""
    if not 0 <= stage < candidate.pp:
        raise ValueError(f"stage {stage}: the candidate has {candidate.pp} pipeline stages")
    if candidate.pp == 1:
        return 0
    with _fake_world(candidate.world_size, 0):
        layout = _plugin(candidate).layout
    coordinate = [stage if axis is Axis.PP else 0 for axis in layout.axes]
    return ProcessGroupMesh.ravel(coordinate, layout.sizes)


@contextlib.contextmanager
def _fake_world(world_size: int, rank: int) -> Iterator[None]:
    if dist.is_initialized():
        raise PlanTraceError(
            "the planner's trace initialises torch.distributed with the fake backend, and this process already has "
            "a process group: run the prediction before init_process_group (or in another process)"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # it logs each meta-kernel refusal the oracle then answers
    try:
        yield
    finally:
        fake_log.setLevel(level)
        dist.destroy_process_group()


def _plugin(candidate: Candidate) -> HybridParallelPlugin:
    if candidate.plugin == "gemini":  # GeminiPlugin's tp_size: the same ShardFormer split (no pp, no sp), then chunks
        return HybridParallelPlugin(tp_size=candidate.tp, pp_size=1, precision="fp32")
    arguments = dict(candidate.plugin_arguments(), precision="fp32")  # the cast is done here, on meta
    if candidate.checkpoint_ratio:
        ratio = GradientCheckpointConfig(gradient_checkpointing_ratio=candidate.checkpoint_ratio)
        arguments["gradient_checkpoint_config"] = ratio
    arguments.pop("cpu_offload", None)
    if candidate.plugin == "moe_hybrid":
        return MoeHybridParallelPlugin(**arguments)
    return HybridParallelPlugin(**arguments)


def _to_fake(module: nn.Module, mode: FakeTensorMode, dtype: torch.dtype) -> None:
    """The module's meta parameters and buffers as CPU FakeTensors (the same objects' places, attributes kept). A
    parameter held in two places (a tied LM head) stays one: replaced once, it was counted twice (its bytes, its
    gradient and its optimizer states: Qwen2.5-3B's 311M-element embedding, 10 % of the model)."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or isinstance(param, FakeTensor):
                continue
            if id(param) not in made:
                data = param.data.to(dtype) if param.is_floating_point() else param.data
                fake = nn.Parameter(FakeTensor(mode, data.to("meta"), _CPU), requires_grad=param.requires_grad)
                fake.__dict__.update(param.__dict__)
                made[id(param)] = fake
            sub._parameters[name] = made[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and not isinstance(buffer, FakeTensor):
                sub._buffers[name] = FakeTensor(mode, buffer.to("meta"), _CPU)


ChunkScope = Callable[[int], contextlib.AbstractContextManager[None]]


def _no_scope(chunk: int) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _stage_modules(shape: ModelShape, candidate: Candidate) -> tuple[list[nn.Module], bool, ChunkScope]:
    """The modules this rank runs (its stage's chunks, or the whole model), whether it is the first stage (its chunk
    0 is then the model's first: interleaved and ZB-V alike), and the scope each chunk runs in (an interleaved stage
    manager answers `is_first_stage` / `is_last_stage` per chunk, inside `switch_model_chunk_id`)."""
    with torch.device("meta"):
        model = build_model(shape)
    if candidate.plugin not in ("hybrid", "moe_hybrid"):
        if candidate.checkpoint_ratio:  # every layer, in full or under the selective op policy
            enable_activation_checkpointing(model, candidate.checkpoint_mode)
        if candidate.tp == 1:
            return [model], True, _no_scope
    plugin = _plugin(candidate)  # GeminiPlugin at tp > 1: ShardFormer after the checkpointing switch, as cx-train
    composed = compose_model(
        model, plugin.shard_config, plugin.custom_policy, plugin.stage_manager, torch.float32,
        torch.device("meta"), plugin=type(plugin).__name__,
    )  # fmt: skip
    if composed.pipeline is None:
        return [composed.module], True, _no_scope
    manager = plugin.stage_manager
    assert manager is not None
    scope = manager.switch_model_chunk_id if manager.is_interleave else _no_scope
    return list(composed.pipeline.chunks), manager.is_first_stage(ignore_chunk=True), scope


def tp_rank_model(shape: ModelShape, candidate: Candidate) -> nn.Module:
    """The module one rank of `candidate` holds, on the meta device (ShardFormer's split at tp > 1), pp 1 only."""
    if candidate.pp > 1:
        raise ValueError("tp_rank_model: a pipeline rank holds stage chunks, not one module")
    with _fake_world(candidate.world_size, 0):
        modules, _, _ = _stage_modules(shape, candidate)
    return modules[0]


def _backward(output: Any) -> None:
    """The backward a schedule runs: from the loss on the last stage, from the received gradient elsewhere."""
    if isinstance(output, torch.Tensor):
        output.backward(None if output.dim() == 0 else torch.empty_like(output))
        return
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        loss.backward()
        return
    if isinstance(output, dict) and isinstance(output.get("hidden_states"), torch.Tensor):
        sent: torch.Tensor = output["hidden_states"]
        sent.backward(torch.empty_like(sent))  # the gradient the next stage sends back
        return
    raise TypeError(f"the traced stage returned {type(output).__name__}, with no loss or hidden_states")


def _run(modules: list[nn.Module], first: bool, scope: ChunkScope, shape: ModelShape, candidate: Candidate,
         seq_len: int, oracle: ValueOracle, dtype: torch.dtype, tracker: MemTracker, saved: list[dict[str, int]],
         ops: _OpCount) -> None:  # fmt: skip
    """One micro-batch forward and backward through the rank's chunks (in turn, as a schedule would)."""
    batch = candidate.micro_batch_size
    with unset_fake_temporarily():
        ids_value = torch.arange(batch * seq_len, dtype=torch.long).reshape(batch, seq_len) % shape.vocab_size
        labels_value = ids_value.clone()
    ids = oracle.give(torch.empty(batch, seq_len, dtype=torch.long), ids_value)
    labels = oracle.give(torch.empty(batch, seq_len, dtype=torch.long), labels_value)
    outputs: list[Any] = []
    for index, module in enumerate(modules):
        arguments: dict[str, Any] = {"input_ids": ids, "labels": labels}
        if not (first and index == 0):
            local_seq = seq_len // max(candidate.sequence_split, 1)
            arguments["hidden_states"] = torch.empty(batch, local_seq, shape.hidden_size, dtype=dtype).requires_grad_()
        with scope(index):
            outputs.append(module(**arguments))
    saved.append(_categories(tracker.get_tracker_snapshot()))
    ops.forward = ops.count
    ops.backward_started = True
    for output in reversed(outputs):
        _backward(output)


LayerSlope = tuple[int, ...]  # what one more decoder layer per pipeline slot adds to each figure of a trace


def trace_stage(
    shape: ModelShape,
    candidate: Candidate,
    seq_len: int,
    stage: int = 0,
    shallow: ActivationTrace | None = None,
    slope: LayerSlope | None = None,
) -> ActivationTrace:
    """Trace one micro-batch (candidate.micro_batch_size sequences of seq_len tokens) through `stage`.

    A stage of more than `_EXACT_LAYERS` decoder layers is traced twice, as the same model with `base` and
    `base + 1` layers per stage (`base`: 2, or past DeepSeek's dense first layers), and every figure extrapolated
    along that per-layer slope to the stage's real layer count (ceil(layers / (pp x chunks))): a model's layers are
    alike, so the figures are linear in their number, and an 8B model traces in seconds instead of minutes.
    `shallow`: the first of those two traces when already made (`trace_shallow`); `slope`: the per-layer slope when
    already known (`layer_slope`, e.g. of another stage of the same split: then no trace runs here)."""
    if not 0 <= stage < candidate.pp:
        raise ValueError(f"stage {stage}: the candidate has {candidate.pp} pipeline stages")
    base = shallow_layers(shape, candidate)
    if base is None:
        return _trace_exact(shape, candidate, seq_len, stage)
    small = trace_shallow(shape, candidate, seq_len, stage) if shallow is None else shallow
    if slope is None:
        slope = layer_slope(shape, candidate, seq_len, stage, small)
    steps = -(-shape.num_layers // (candidate.pp * candidate.num_model_chunks)) - base
    values = [a + d * steps for a, d in zip(astuple(small)[1:], slope, strict=True)]
    return ActivationTrace(stage, *values)


def layer_slope(
    shape: ModelShape, candidate: Candidate, seq_len: int, stage: int, shallow: ActivationTrace
) -> LayerSlope:
    """What one more decoder layer per slot adds to each figure of `stage`: the model one layer per slot deeper than
    `shallow` (`trace_shallow`'s trace of that stage), traced, less `shallow`."""
    base = shallow_layers(shape, candidate)
    if base is None:
        raise ValueError(f"{shape.num_layers} layers per stage are traced as they are, not extrapolated")
    slots = candidate.pp * candidate.num_model_chunks
    large = _trace_exact(_with_layers(shape, (base + 1) * slots), candidate, seq_len, stage)
    return tuple(b - a for a, b in zip(astuple(shallow)[1:], astuple(large)[1:], strict=True))


def shallow_layers(shape: ModelShape, candidate: Candidate) -> int | None:
    """The decoder layers per pipeline slot of the shallower model `trace_stage` extrapolates from (None: the
    stage is shallow enough to trace as it is)."""
    per_stage = -(-shape.num_layers // (candidate.pp * candidate.num_model_chunks))
    base = max(2, _dense_prefix(shape) + 1)
    return None if per_stage <= max(_EXACT_LAYERS, base + 1) else base


def trace_shallow(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int = 0) -> ActivationTrace:
    """`stage` of the same model with `shallow_layers` layers per slot (fewer than the real stage holds): every
    figure of it is at most the real stage's (a deeper stage runs the same layers and more), so it is a floor,
    and the first of the two traces `trace_stage` extrapolates from."""
    base = shallow_layers(shape, candidate)
    if base is None:
        return _trace_exact(shape, candidate, seq_len, stage)
    slots = candidate.pp * candidate.num_model_chunks
    return _trace_exact(_with_layers(shape, base * slots), candidate, seq_len, stage)


def _dense_prefix(shape: ModelShape) -> int:
    value = getattr(shape.config, "first_k_dense_replace", 0)
    return value if isinstance(value, int) else 0


def _with_layers(shape: ModelShape, layers: int) -> ModelShape:
    """The same architecture with `layers` decoder layers (only its config is read by the trace)."""
    if isinstance(shape.config, GPTConfig):
        config: Any = replace(shape.config, num_layers=layers)
    else:
        config = copy.deepcopy(shape.config)
        config.num_hidden_layers = layers
    return replace(shape, num_layers=layers, config=config)


def _trace_exact(shape: ModelShape, candidate: Candidate, seq_len: int, stage: int) -> ActivationTrace:
    dtype = _DTYPES[candidate.precision]
    with _fake_world(candidate.world_size, stage_rank(candidate, stage)):
        modules, first, scope = _stage_modules(shape, candidate)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for module in modules:
            _to_fake(module, mode, dtype)
        ops = _OpCount()
        tracker = _PeakTracker(ops)
        saved: list[dict[str, int]] = []
        for module in modules:
            tracker.track_external(module)
        with mode, ValueOracle(mode, _routing(shape, candidate)) as oracle, tracker:
            _run(modules, first, scope, shape, candidate, seq_len, oracle, dtype, tracker, saved, ops)
        peak = _categories(tracker.get_tracker_snapshot("peak"))
        end = _categories(tracker.get_tracker_snapshot())
    parameters = peak.get("PARAM", 0) + peak.get("BUFFER", 0)
    gradients = peak.get("GRAD", 0)
    activations = sum(peak.get(k, 0) for k in _ACTIVATION_KINDS)
    forward_end = sum(saved[0].get(k, 0) for k in _ACTIVATION_KINDS)
    trained = {
        id(p): (p.numel(), "experts" in name.split(".") and "shared_experts" not in name)
        for m in modules
        for name, p in m.named_parameters()
        if p.requires_grad and p.device.type != "meta"
    }
    return ActivationTrace(
        stage, parameters, activations, gradients, end.get("GRAD", 0), peak.get("Total", 0), forward_end,
        sum(count for count, _ in trained.values()), sum(count for count, expert in trained.values() if expert),
        ops.forward, ops.count - ops.forward, len(trained), ops.forward_flops, ops.recompute_flops,
    )  # fmt: skip


def _routing(shape: ModelShape, candidate: Candidate) -> Routing | None:
    """The skewed router of a MoeHybrid candidate with `routing_skew` > 1 (ep rank 0 hot); None: balanced."""
    if candidate.plugin != "moe_hybrid" or candidate.routing_skew == 1:
        return None
    load = hot_rank_load(candidate.routing_skew, candidate.ep, shape.num_experts, shape.top_k)
    return Routing(load, shape.num_experts, candidate.ep)


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """MemTracker's per-device figures summed over devices, keyed by category name ("ACT", "Total", ...)."""
    summed: dict[str, int] = {}
    for by_kind in snapshot.values():
        for kind, nbytes in by_kind.items():
            name = str(getattr(kind, "name", kind))
            summed[name] = summed.get(name, 0) + nbytes
    return summed
