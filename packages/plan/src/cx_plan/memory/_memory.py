"""`predict_memory`: the bytes one rank holds during a training step of a `Candidate`, by component, and the peak.

The model states follow each plugin's sharding over its gradient group (dp, x sp under all_to_all / ring_attn; the
stage's trained parameters come from the trace, so tensor, pipeline and expert sharding are the policies' own).
Parameters at the compute precision (DDP / FSDP keep fp32 parameters and cast in autocast / MixedPrecision), gradients
(accumulation without a pipeline keeps the summed gradient live beside the next micro-batch's), AdamW's two fp32 moments
(2 + 2 bytes under the ZeRO plugins' optimizer_states_dtype="bf16": `Candidate.moment_bytes`), fp32 master weights of
the 16-bit plugins (LowLevelZero, Gemini, hybrid). Activations come from the FakeTensor trace of one micro-batch
(`trace_stage`); a 1F1B pipeline stage s also keeps the saved activations of the pp - s - 1 micro-batches it has started
and not finished (interleaved / ZBV: one more per extra model chunk, bounded by the micro-batch count). Comm buffers:
DDP's gradient buckets (a second copy of the gradients), FSDP's and Gemini's gathered parameters (Gemini's: the
long-lived chunks and those of the layer in use, `_gemini_chunks`; the whole model when no layout is given). The peak is
the larger of two instants: the trace's peak inside the backward (model states, activations, the gradients live then)
and, under ZeRO 1/2, the end of the backward (model states, the gradients packed into the reduce bucket and this rank's
reduced fp32 shard; cx-zero keeps an fp32 master shard then even for fp32 weights); under hybrid ZeRO 0 over dp > 1, the
gradients and their packed copy for the all-reduce; unsharded 16-bit runs, the step's fp32 copy of the gradients beside
the 16-bit ones.

Under `optimizer=muon` (`_muon_bytes`, the split from `trace._muon_split`): one fp32 momentum per hidden-matrix element,
AdamW's two moments on the rest. Where the plugin shards parameters (ZeRO 1/2 or Gemini over dp > 1, tensor parallelism
at ZeRO 0) every Muon matrix is stepped whole on one owner rank, which keeps its whole fp32 master and state: the
busiest owner of cx's own assignment is predicted (its states instead of a 1/dp share, its whole masters beside the ZeRO
master shards), and a third instant, the step, adds its gathered whole gradients and the gather's receive buffers
(Gemini gathers the master too: twice that). The AdamW parameters: under LowLevelZero's ZeRO 1/2 on the flat shards like
a plain AdamW (1/dp of their moments on every rank, their masters in the ZeRO master shards); under Gemini and tp at
ZeRO 0 whole on owners like the matrices (`_muon_split.rank_load`). Unsharded runs step every matrix on every rank: the
instant adds Newton-Schulz's workspace on the largest matrix. Under tp or pp the stage's share of the whole model's
split is taken in proportion to its elements (whole matrices: its elements x tp); a data-parallel layout's is the
split's own (the trace counts a tied head beside its embedding, cx steps it once). MoeHybridParallelPlugin at tp > 1
replicates the routed experts over tp: each rank keeps the states of all its experts and only the rest has tp owners.
TorchFSDPPlugin over dp > 1 keeps every state on its row shards (no whole master); the step instant adds the busiest
owner's gathered bf16 matrices, their Newton-Schulz results and workspace, and the rank's nesterov updates.
Hybrid ZeRO 1/2 at tp > 1 (`tp_zero_owners`): the busiest dp owner's fp32 tp slices and its busiest tp owner's whole
masters and momenta, and at the step both gathers' receive buffers. Where those whole masters are on the CPU
(`muon_on_host`: cpu_offload, Gemini with CPU optimizer data) the step's gathered wholes are received there too: they
count in `cpu_offloaded`, not in the device's step instant.
"""

from __future__ import annotations

from dataclasses import dataclass

from cx_plan._candidate import Candidate
from cx_plan.memory._fsdp_memory import fsdp_bytes
from cx_plan.memory._gemini_chunks import gemini_gathered_elements
from cx_plan.trace._activations import ActivationTrace, trace_stage
from cx_plan.trace._model_spec import ModelShape, ParameterCounts
from cx_plan.trace._muon_split import (
    MuonSplit,
    busiest_owner,
    experts_stepped_locally,
    fsdp_rows,
    muon_on_host,
    muon_split,
    rank_load,
    tp_zero_owners,
    two_level_loads,
    whole_group,
)

__all__ = ["MemoryPrediction", "predict_for_shape", "predict_memory", "predict_memory_from_traces"]

_ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2}
_FP32 = 4
_ZERO_BUCKET_ELEMENTS = 12 * 1024 * 1024  # LowLevelZero / hybrid's default reduce_bucket_size_in_m


@dataclass(frozen=True)
class MemoryPrediction:
    """Per-rank bytes of the busiest rank (the pipeline stage whose peak is highest)."""

    candidate: Candidate
    stage: int
    parameters: int
    gradients: int  # kept between steps or built over the backward (the part live at the peak)
    optimizer_states: int
    master_weights: int
    activations: int  # one micro-batch at the trace's peak
    pipeline_inflight: int  # saved activations of the other micro-batches a pipeline stage holds
    comm_buffers: int
    cpu_offloaded: int  # optimizer states / master weights moved to the CPU (in the peak only when the CPU is it)
    end_of_backward: int = 0  # everything live late in the backward, activations gone (0: not modelled)

    @property
    def backward_peak(self) -> int:
        """The components together: the instant of the trace's peak, inside the backward."""
        return (
            self.parameters + self.gradients + self.optimizer_states + self.master_weights + self.activations
            + self.pipeline_inflight + self.comm_buffers
        )  # fmt: skip

    @property
    def peak(self) -> int:
        return max(self.backward_peak, self.end_of_backward)

    def components(self) -> dict[str, int]:
        """Name -> bytes, in the order the report lists them."""
        names = ("parameters", "gradients", "optimizer_states", "master_weights", "activations",
                 "pipeline_inflight", "comm_buffers")  # fmt: skip
        return {name: getattr(self, name) for name in names}


def _inflight(candidate: Candidate, stage: int) -> int:
    """Micro-batches a stage holds saved activations of, besides the one it is running, at its peak."""
    if candidate.pp == 1:
        return 0
    started = candidate.pp - stage - 1 + (candidate.num_model_chunks - 1) * candidate.pp
    return min(started, candidate.num_microbatches - 1)


def _gradient_ranks(c: Candidate) -> int:
    """The ranks gradients are averaged and ZeRO states sharded over: dp, times sp under all_to_all / ring_attn (the
    hybrid plugins' gradient group spans the sp axis, whose ranks hold the same whole parameters)."""
    return c.dp * c.sp


def _shard(c: Candidate, n: int, experts: int, itemsize: int) -> int:
    """Bytes of `n` elements sharded by ZeRO: dense ones over the gradient group (dp x sp), routed experts under
    ep > 1 over moe_dp only (the ep ranks hold different experts, so only the moe_dp ranks holding the same ones split
    their states; with ep 1 the experts are in the one dense group)."""
    dense = _gradient_ranks(c)
    return itemsize * (n - experts) // dense + itemsize * experts // (c.moe_dp if c.ep > 1 else dense)


def _accumulated(c: Candidate, itemsize: int, n: int) -> int:
    """Gradient accumulation without a pipeline: the earlier micro-batches' summed gradient (`itemsize` x n) stays
    live through the next micro-batch's backward, beside the new gradients autograd makes before adding them in.
    Gemini runs one micro-batch; FSDP counts its own (`_fsdp_memory`: no_sync's unsharded sums); a pipeline's
    stage is traced as is."""
    if c.pp > 1 or c.num_microbatches == 1 or c.plugin in ("gemini", "torch_fsdp"):
        return 0
    return itemsize * n


@dataclass(frozen=True)
class _MuonBytes:
    optimizer: int  # the rank's Muon momenta and AdamW moments (whole ones it owns, or its shards)
    whole_masters: int  # the whole fp32 masters it owns, beside the plugin's own master (shards)
    step: int  # transient at the step: gathered whole gradients and receive buffers, or Newton-Schulz's workspace


def _muon_bytes(c: Candidate, n: int, e: int, split: MuonSplit) -> _MuonBytes:
    """MuonWithAdamW's bytes on the busiest rank of a stage training `n` elements, `e` of them routed experts'
    (module docstring). Where the experts are stepped locally (`experts_stepped_locally`: replicated over tp), the
    rank's expert states beside the busiest tp owner's share of the rest; they take no whole master and no gather."""
    if not experts_stepped_locally(c):
        return _owned_bytes(c, n, split)
    dense, experts = split.part(expert=False), split.part(expert=True)
    owned = _owned_bytes(c, n - e, dense)
    local = int(min(1.0, e / experts.total) * experts.state_bytes) if experts.total else 0
    return _MuonBytes(owned.optimizer + local, owned.whole_masters, owned.step)


def _owned_bytes(c: Candidate, n: int, split: MuonSplit) -> _MuonBytes:
    """The busiest owner's bytes of `split` for a stage training `n` of its elements (every rank steps all it holds
    when nothing is gathered)."""
    group = whole_group(c)
    scale = 1.0  # the whole model (the trace counts a tied head again: the split's own count is the one cx steps)
    if (c.tp, c.pp, c.ep) != (1, 1, 1) and split.total:  # a stage's share, its matrices whole
        scale = min(1.0, n * c.tp / split.total)
    if group == 1:
        largest = busiest_owner(split, 1).largest_matrix
        m, k = largest
        workspace = _FP32 * m * k + 2 * 2 * m * k + 3 * 2 * m * m  # nesterov update fp32; bf16 X, new X; A, B, A @ A
        return _MuonBytes(int(scale * split.state_bytes), 0, workspace)
    if fsdp_rows(c):  # states on the row shards; the owner's bf16 wholes, their result and the send copy
        owned = busiest_owner(split, group, muon_only=True)
        m, k = owned.largest_matrix
        shard = -(-split.muon_elements // group)
        workspace = 2 * 2 * m * k + 3 * 2 * m * m  # bf16 X, new X; A, B, A @ A on its largest matrix
        step = 3 * 2 * owned.muon_elements + workspace + _FP32 * shard + 2 * shard  # + nesterov updates, rows back
        return _MuonBytes(split.state_bytes // group, 0, step)
    if tp_zero_owners(c):  # dp-whole fp32 slices (1/tp of the dp owner's matrices) and the tp owner's wholes
        dp_elements, owned = two_level_loads(split, group, c.tp)
        slices = dp_elements // c.tp
        state = int(scale * rank_load(c, split).state_bytes)
        return _MuonBytes(state, _FP32 * (slices + owned.elements), 2 * _FP32 * (slices + owned.elements))
    load = rank_load(c, split)  # the whole parameters it owns, and its AdamW shards under LowLevelZero
    elements = int(scale * load.elements)
    received = 2 if c.plugin == "gemini" else 1  # Gemini gathers the master beside the gradient
    return _MuonBytes(int(scale * load.state_bytes), _FP32 * elements, 2 * received * _FP32 * elements)


def _for_stage(
    candidate: Candidate,
    trace: ActivationTrace,
    counts: ParameterCounts | None,
    host_is_device: bool,
    muon: MuonSplit | None = None,
    gathered: int | None = None,
) -> MemoryPrediction:
    c, n, e = candidate, trace.parameter_count, trace.expert_parameter_count
    w = _ITEMSIZE[c.precision]
    dp = _gradient_ranks(c)
    live_grads = trace.gradient_bytes  # param.grad live at the trace's peak, at the compute precision
    optimizer, master, comm = c.moment_bytes * n, 0, 0
    activations, end = trace.activation_bytes, 0
    if c.plugin == "torch_ddp":  # fp32 parameters; DDP's buckets hold a second copy of every gradient
        parameters, comm = _FP32 * n, _FP32 * n
        gradients = live_grads * _FP32 // w + _accumulated(c, _FP32, n)
    elif c.plugin == "torch_fsdp":  # fp32 shards; the root unit, or each block, gathered for compute (_fsdp_memory)
        fsdp = fsdp_bytes(c, trace, counts)
        parameters, gradients, optimizer, comm = fsdp.parameters, fsdp.gradients, fsdp.optimizer_states, fsdp.gathered
        activations, end = fsdp.activations, fsdp.end_of_backward
    else:
        parameters = w * n
        master = _FP32 * n if c.half_precision else 0
        if c.stage >= 1:
            optimizer = _shard(c, n, e, c.moment_bytes)
            master = _shard(c, n, e, _FP32) if c.half_precision else 0
        if c.plugin == "gemini":  # this rank's chunk shards; the gathered chunks in use take the gradients
            parameters, gradients, comm = w * n // dp, 0, w * (n if gathered is None else min(n, gathered))
        else:
            gradients = live_grads + _accumulated(c, w, n)
            if c.stage >= 1 and dp > 1:  # cx-zero keeps a separate fp32 master shard even for fp32 working weights
                master = _shard(c, n, e, _FP32)
    muon_step = 0
    if c.muon:
        if muon is None:
            raise ValueError("optimizer muon: the memory prediction needs the model's Muon split (muon_split)")
        muon_bytes = _muon_bytes(c, n, e, muon)
        optimizer, master, muon_step = muon_bytes.optimizer, master + muon_bytes.whole_masters, muon_bytes.step
    # what is moved to the CPU leaves both instants below, unless the CPU is the device (the same memory)
    offloaded = 0
    # cx-zero's cpu_offload keeps the whole fp32 side on the CPU: moments, master shard and the gradients reduced into
    # it (`cx_zero._reduce` moves each reduced bucket to the master's device)
    fp32_on_host = c.cpu_offload and not host_is_device
    if c.cpu_offload:
        offloaded = optimizer + master
        optimizer, master = (0, 0) if fp32_on_host else (optimizer, master)
    if c.plugin == "gemini" and (c.offload_optim_frac or c.offload_param_frac):
        moved_optimizer = int(optimizer * c.offload_optim_frac)
        moved_master = int(master * c.offload_param_frac)
        offloaded = moved_optimizer + moved_master
        if not host_is_device:
            optimizer, master = optimizer - moved_optimizer, master - moved_master
    if muon_on_host(c) and not host_is_device:  # the gathered whole gradients (and masters) meet on the CPU
        offloaded, muon_step = offloaded + muon_step, 0
    if c.plugin in ("low_level_zero", "hybrid", "moe_hybrid") and c.stage >= 1 and dp > 1:
        # the end of the backward: the activations are gone, the gradients (stage 1: all of them; stage 2: released
        # bucket by bucket) wait in the packed bucket being reduce-scattered into this rank's shard
        bucket = min(n, _ZERO_BUCKET_ELEMENTS) * w
        held = w * n if c.stage == 1 else min(w * n, 2 * bucket)
        end = parameters + optimizer + master + held + bucket + (0 if fp32_on_host else _shard(c, n, e, _FP32))
    elif c.plugin == "gemini":
        # late in the backward, activations mostly gone: each chunk's own value slice copied aside at its first
        # gradient write and its reduced gradient slice, beside the gathered chunks
        end = parameters + optimizer + master + comm + 2 * w * n // dp
    elif c.plugin in ("hybrid", "moe_hybrid") and dp > 1:
        # ZeRO 0 reduces once per step: the gradients beside their packed copy (routed experts only when moe_dp > 1)
        reduced = n - (e if c.moe_dp == 1 else 0)
        end = parameters + optimizer + master + w * n + w * reduced + (_FP32 * n if c.half_precision else 0)
    elif c.plugin in ("low_level_zero", "hybrid", "moe_hybrid") and c.half_precision:
        # unsharded mixed precision: the step reads fp32 copies of the 16-bit gradients beside them
        end = parameters + optimizer + master + w * n + (0 if fp32_on_host else _FP32 * n)
    if c.muon:  # the step: the gradients it reads beside the gathered whole ones or Newton-Schulz's workspace
        if c.plugin == "gemini":
            read = 2 * w * n // dp
        elif c.plugin == "torch_fsdp":
            read = _FP32 * n // max(1, c.dp)  # the fp32 gradient shards
        elif whole_group(c) > 1 and c.stage >= 1:
            read = 0 if fp32_on_host else _shard(c, n, e, _FP32)
        else:
            read = (_FP32 if c.plugin == "torch_ddp" else w) * n + (_FP32 * n if c.half_precision else 0)
        end = max(end, parameters + optimizer + master + read + muon_step)
    return MemoryPrediction(
        candidate=c,
        stage=trace.stage,
        parameters=parameters,
        gradients=gradients,
        optimizer_states=optimizer,
        master_weights=master,
        activations=activations,
        pipeline_inflight=_inflight(c, trace.stage) * trace.saved_bytes,
        comm_buffers=comm,
        cpu_offloaded=offloaded,
        end_of_backward=end,
    )


def predict_memory_from_traces(
    candidate: Candidate,
    traces: list[ActivationTrace],
    counts: ParameterCounts | None = None,
    host_is_device: bool = False,
    muon: MuonSplit | None = None,
    gemini_gathered: int | None = None,
) -> MemoryPrediction:
    """The busiest stage's prediction from already-made traces (one per stage traced); `counts` (the shape's) are
    needed for per-block FSDP, whose gathered bytes are the root unit's and the largest blocks'. `host_is_device`:
    the devices are the CPU (`--device cpu`), so "offloaded" optimizer states stay in the memory that peaks. `muon`:
    the model's Muon split (`muon_split`), needed for a candidate with optimizer muon. `gemini_gathered`: the elements
    GeminiPlugin holds gathered at once (`predict_for_shape` derives it; None: the whole model, as one chunk)."""
    if not traces:
        raise ValueError("predict_memory_from_traces: no trace given")
    made = (_for_stage(candidate, trace, counts, host_is_device, muon, gemini_gathered) for trace in traces)
    return max(made, key=lambda prediction: prediction.peak)


def predict_memory(
    shape: ModelShape, candidate: Candidate, seq_len: int, host_is_device: bool = False
) -> MemoryPrediction:
    """Trace the first and the last pipeline stage (the others lie between) and predict the busiest."""
    stages = sorted({0, candidate.pp - 1})
    traces = [trace_stage(shape, candidate, seq_len, s) for s in stages]
    return predict_for_shape(candidate, traces, shape, host_is_device)


def predict_for_shape(
    candidate: Candidate, traces: list[ActivationTrace], shape: ModelShape, host_is_device: bool = False
) -> MemoryPrediction:
    """`predict_memory_from_traces` with what `shape` says: its parameter counts, its Muon split (optimizer muon) and
    the elements a Gemini candidate holds gathered at once (`gemini_gathered_elements`)."""
    split = muon_split(shape) if candidate.muon else None
    gemini = candidate.plugin == "gemini"
    gathered = gemini_gathered_elements(shape, candidate.dp, candidate.tp) if gemini else None
    return predict_memory_from_traces(candidate, traces, shape.parameters, host_is_device, split, gathered)
