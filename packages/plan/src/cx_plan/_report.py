"""The planner's answer: candidates ranked (those that fit by predicted step time, then those that do not by peak
memory), as a table, as JSON, with the reason each rejected one fails and the exact plugin constructor call and
`cx-train` command of the best.

The memory side comes in as any object with `fits`, `peak_bytes` and `reason` (the memory model's verdict), so a
measurement harness can hand in its own figures and reuse the formatting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from cx_plan._candidate import Candidate
from cx_plan._devices import Device
from cx_plan.step_time._step_time import StepTime

__all__ = ["MemoryVerdict", "PlanReport", "PlanRow", "constructor_call", "rank_rows", "row_label", "train_command"]

_CLASSES = {
    "torch_ddp": "TorchDDPPlugin",
    "torch_fsdp": "TorchFSDPPlugin",
    "low_level_zero": "LowLevelZeroPlugin",
    "gemini": "GeminiPlugin",
    "hybrid": "HybridParallelPlugin",
    "moe_hybrid": "MoeHybridParallelPlugin",
}
_GB = 1e9


class MemoryVerdict(Protocol):
    """What the report needs of the memory model: whether the candidate fits, its predicted peak per rank, and
    (when it does not fit) the reason naming the component that overflows, with a suggestion."""

    @property
    def fits(self) -> bool: ...

    @property
    def peak_bytes(self) -> int: ...

    @property
    def reason(self) -> str: ...


@dataclass(frozen=True)
class PlanRow:
    candidate: Candidate
    memory: MemoryVerdict
    step: StepTime

    def as_json(self) -> dict[str, Any]:
        c, step = self.candidate, self.step
        return {
            "label": row_label(c),
            "candidate": {name: getattr(c, name) for name in c.__dataclass_fields__},
            "fits": self.memory.fits,
            "tight": _tight(self),
            "peak_bytes": self.memory.peak_bytes,
            "reason": self.memory.reason,
            "step_s": step.step_s,
            "tokens_per_s": step.tokens_per_s,
            "mfu": step.mfu,
            "compute_s": step.compute_s,
            "recompute_s": step.recompute_s,
            "bubble_s": step.bubble_s,
            "optimizer_s": step.optimizer_s,
            "communication_s": dict(step.communication_s),
            "hidden_s": step.hidden_s,
        }


def _tight(row: PlanRow) -> bool:
    """Whether the row fits only inside the device's reserve (a verdict without the attribute: no)."""
    return bool(row.memory.fits and getattr(row.memory, "tight", False))


def row_label(candidate: Candidate) -> str:
    """The candidate's label, with Gemini's placement and offload (which `Candidate.label` leaves out)."""
    c, extra = candidate, ""
    if c.plugin == "gemini":
        extra += " auto" if c.placement_policy == "auto" else ""
        extra += f" offload-optim{c.offload_optim_frac:g}" if c.offload_optim_frac else ""
        extra += f" offload-param{c.offload_param_frac:g}" if c.offload_param_frac else ""
    if c.cpu_offload:
        extra += " cpu-offload"
    return c.label() + extra


def _bytes(count: int) -> str:
    return f"{count / _GB:.2f} GB" if count >= _GB else f"{count / 1e6:.2f} MB"


def rank_rows(rows: Sequence[PlanRow]) -> list[PlanRow]:
    """Fitting candidates fastest first, then those that do not fit smallest peak first, then those cx refuses to
    build (no peak: the memory model could not trace them). Equal step times go to fewer, larger micro-batches (which
    run matmuls nearer peak, as the one-fraction compute model cannot see), then per-block FSDP before one root unit,
    then by label, so the order is deterministic."""

    def key(row: PlanRow) -> tuple[int, float, int, bool, str]:
        c = row.candidate
        whole = c.fsdp_wrap == "model" and c.plugin == "torch_fsdp"  # per-block FSDP first: never more memory
        if row.memory.fits:  # comfortable fits first, then those inside the reserve
            return _tight(row), float(f"{row.step.step_s:.9g}"), c.num_microbatches, whole, row_label(c)
        return (2 if row.memory.peak_bytes else 3), row.memory.peak_bytes, c.num_microbatches, whole, row_label(c)

    return sorted(rows, key=key)


def _merge_zero_twins(rows: Sequence[PlanRow]) -> tuple[list[PlanRow], dict[int, str]]:
    """The rows with each ZeRO-2 layout dropped whose ZeRO-1 twin (the same layout at stage 1) is also there with
    the same peak and step time, and for each kept twin (by id) the line that says why the two are one row."""
    by_layout = {(dataclasses.replace(r.candidate, zero_stage=None), r.candidate.stage): r for r in rows}
    kept: list[PlanRow] = []
    notes: dict[int, str] = {}
    for row in rows:
        c = row.candidate
        if c.plugin in ("low_level_zero", "hybrid", "moe_hybrid") and c.stage in (1, 2):
            other = by_layout.get((dataclasses.replace(c, zero_stage=None), 3 - c.stage))
            same = other is not None and (other.memory.peak_bytes, other.step.step_s) == (
                row.memory.peak_bytes, row.step.step_s)  # fmt: skip
            if same and c.stage == 2:
                continue
            if same:
                notes[id(row)] = (
                    "zero1 = zero2 here: the same peak and step time (the peak is inside the backward, where ZeRO-2's "
                    "sharded gradients do not lower it, and both reduce-scatter the same bytes); ZeRO-2 frees the "
                    "gradients as they are reduced, which only lowers the end of the backward"
                )
        kept.append(row)
    return kept, notes


def constructor_call(candidate: Candidate, block_class: str | None = None) -> str:
    """`HybridParallelPlugin(tp_size=2, pp_size=2, ...)`, as the user writes it (cx_plugins or colossalai); per-block
    FSDP names the model's decoder-layer class (`block_class`) in its `ModuleWrapPolicy`."""
    arguments = ", ".join(f"{k}={v!r}" for k, v in candidate.plugin_arguments().items())
    if block_class is not None:
        arguments = arguments.replace("{DecoderLayer}", "{" + block_class + "}")
    call = f"{_CLASSES[candidate.plugin]}({arguments})"
    if candidate.checkpoint_ratio and candidate.plugin in ("hybrid", "moe_hybrid"):
        ratio = f"GradientCheckpointConfig(gradient_checkpointing_ratio={candidate.checkpoint_ratio:g})"
        call = call[:-1] + (", " if arguments else "") + f"gradient_checkpoint_config={ratio})"
    elif candidate.checkpoint_mode == "selective-op":
        call += "  # and cx_plugins.enable_activation_checkpointing(model, 'selective-op') before boosting"
    elif candidate.checkpoint_ratio:
        call += "  # and model.gradient_checkpointing_enable() before boosting"
    return call


def train_command(candidate: Candidate, model: str, seq_len: int, model_flags: Sequence[str] = ()) -> str:
    """The `cx-train` command line that runs `candidate` on `model` sized by `model_flags` (`train_flags`): every
    setting a candidate holds has a cx-train flag, so the command runs as printed."""
    c = candidate
    per_rank = c.micro_batch_size * c.num_microbatches
    parts = ["cx-train", f"--model {model}", *model_flags, f"--plugin {c.plugin}", f"--nproc {c.world_size}"]
    parts += [f"--seq-len {seq_len}", f"--precision {c.precision}"]
    if c.pp > 1:
        parts += [f"--batch-size {per_rank}", f"--microbatches {c.num_microbatches}"]
    else:
        parts.append(f"--batch-size {c.micro_batch_size}")
        if c.num_microbatches > 1:
            parts.append(f"--grad-accum {c.num_microbatches}")
    if c.plugin in ("hybrid", "moe_hybrid"):
        sizes = (("tp", c.tp), ("pp", c.pp), ("sp", c.sp), ("ep", c.ep))
        parts += [f"--{name} {value}" for name, value in sizes if value > 1]
        parts.append(f"--zero {c.stage}")
        if c.pp > 1 and c.pp_style != "1f1b":
            parts.append(f"--pp-style {c.pp_style}")
        if c.sp_mode is not None:
            parts.append(f"--sp-mode {c.sp_mode}")
    if c.plugin == "low_level_zero" and c.stage != 2:
        parts.append(f"--zero {c.stage}")
    if c.checkpoint_mode == "selective-op":
        parts.append("--activation-checkpointing-mode selective-op")
    elif c.checkpoint_ratio == 1.0:
        parts.append("--activation-checkpointing")
    elif c.checkpoint_ratio:  # a ratio of the layers: hybrid / moe_hybrid, through ShardFormer
        parts.append(f"--activation-checkpointing-ratio {c.checkpoint_ratio:g}")
    if c.plugin == "torch_fsdp" and c.fsdp_wrap == "model":
        parts.append("--fsdp-wrap model")
    if c.plugin == "gemini":
        parts += [f"--tp {c.tp}"] if c.tp > 1 else []
        parts += ["--placement auto"] if c.placement_policy == "auto" else []
        parts += [f"--offload-optim-fraction {c.offload_optim_frac:g}"] if c.offload_optim_frac else []
        parts += [f"--offload-param-fraction {c.offload_param_frac:g}"] if c.offload_param_frac else []
    if c.cpu_offload:
        parts.append("--cpu-offload")
    if c.optimizer_states_dtype != "fp32":
        parts.append(f"--optimizer-states-dtype {c.optimizer_states_dtype}")
    if c.muon:
        parts.append(f"--optimizer {c.optimizer}")
    return " ".join(parts)


@dataclass(frozen=True)
class PlanReport:
    """Ranked rows for one model, world and device; `considered` candidates were enumerated, of which `rows` had
    their memory judged (all of them, or the fastest predicted until enough fitted: see `plan(top=...)`)."""

    model: str
    world: int
    seq_len: int
    device: Device
    rows: list[PlanRow]
    considered: int | None = None  # None: every enumerated candidate is in `rows`
    model_flags: tuple[str, ...] = ()  # cx-train's flags that size the model (`_model_spec.train_flags`)
    block_class: str | None = None  # the decoder layer's class, named in per-block FSDP's constructor call
    stopped: str | None = None  # why the search ended before its usual end (the time limit), said in the output
    routing_skew: float = 1.0  # the MoE candidates' (SearchSpace.routing_skew): > 1 predicts the worst ep rank
    expert_load: str | None = None  # a measured histogram's hot-rank shares, said (ExpertLoad.describe)
    skipped: tuple[str, ...] = ()  # layouts left out for the optimizer (`optimizer_skips`), said once

    @property
    def best(self) -> PlanRow | None:
        fitting = [r for r in self.rows if r.memory.fits]
        return fitting[0] if fitting else None

    def table(self, top: int = 10, rejected: int = 5) -> str:
        """The best `top` that fit and the `rejected` closest misses, with their reasons; then the best's call."""
        lines = [
            f"cx-plan: {self.model} on {self.world} x {self.device.name} ({self._memory()}), "
            f"seq {self.seq_len}; {self._judged()}, {sum(r.memory.fits for r in self.rows)} fit",
            *([f"routing skew {self.routing_skew:g}: the worst rank's memory and time"] * (self.routing_skew != 1)),
            *([self.expert_load] if self.expert_load else []),
            *self.skipped,
            f"{'#':>3}  {'configuration':<60} {'fits':<5} {'peak':>10} {'step ms':>9} {'tokens/s':>11} {'MFU':>6}",
        ]
        fitting, twins = _merge_zero_twins([r for r in self.rows if r.memory.fits])
        misses, miss_twins = _merge_zero_twins([r for r in self.rows if not r.memory.fits])  # a miss's twin too
        shown = fitting[:top] + misses[:rejected]
        twins.update(miss_twins)
        for index, row in enumerate(shown, 1):
            step = row.step
            lines.append(
                f"{index:>3}  {row_label(row.candidate):<60} {self._fits(row):<5} "
                f"{_bytes(row.memory.peak_bytes):>10} {step.step_s * 1e3:>9.3f} {step.tokens_per_s:>11,.0f} "
                f"{step.mfu:>6.1%}"
            )
            if not row.memory.fits or _tight(row):
                lines.append(f"     {row.memory.reason}")
            if id(row) in twins:
                lines.append(f"     {twins[id(row)]}")
        if self.stopped:
            lines.append(f"cx-plan {self.stopped}")
        best = self.best
        if best is None:
            lines.append("nothing fits: see the reasons above")
        else:
            lines.append(f"best: {constructor_call(best.candidate, self.block_class)}")
            lines.append(f"      {train_command(best.candidate, self.model, self.seq_len, self.model_flags)}")
        return "\n".join(lines)

    @staticmethod
    def _fits(row: PlanRow) -> str:
        return "tight" if _tight(row) else "yes" if row.memory.fits else "no"

    def _memory(self) -> str:
        """The device's memory as it reports it and the reserve the planner keeps: `85.52 GB = 81,559 MiB; 10%
        reserve, 76.97 GB usable`."""
        device = self.device
        mib = f" = {device.memory_bytes / 2**20:,.0f} MiB" if device.memory_bytes % 2**20 == 0 else ""
        return f"{_bytes(device.memory_bytes)}{mib}; {device.reserve:.0%} reserve, {_bytes(device.usable_bytes)} usable"

    def _judged(self) -> str:
        if self.considered is None or self.considered == len(self.rows):
            return f"{len(self.rows)} candidates"
        return f"{len(self.rows)} of {self.considered} candidates judged (fastest predicted first)"

    def as_json(self) -> dict[str, Any]:
        best = self.best
        return {
            "model": self.model,
            "considered": len(self.rows) if self.considered is None else self.considered,
            "world": self.world,
            "seq_len": self.seq_len,
            "routing_skew": self.routing_skew,
            "expert_load": self.expert_load,
            "device": {
                "name": self.device.name,
                "memory_bytes": self.device.memory_bytes,
                "reserve": self.device.reserve,
                "usable_bytes": self.device.usable_bytes,
                "source": self.device.source,
            },
            "best": None
            if best is None
            else {
                "label": row_label(best.candidate),
                "constructor": constructor_call(best.candidate, self.block_class),
                "cx_train": train_command(best.candidate, self.model, self.seq_len, self.model_flags),
            },
            "rows": [r.as_json() for r in self.rows],
            "stopped": self.stopped,
            "skipped": list(self.skipped),
        }
