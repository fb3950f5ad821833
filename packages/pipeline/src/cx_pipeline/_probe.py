"""The probe: one gradient-free forward of the first micro-batch through every virtual stage, in order, before the
first step (and again whenever the batch's shapes change).

It exchanges each stage's output metadata once (the metadata cache), and it validates the pipeline with an error on
every rank instead of a hang: a stage that cannot take what the previous one sends, a stage that is not the last but
does not return a dict, a forward or criterion that raises. A failing stage sends an error status instead of its
output; later stages pass it on; the host of the last virtual stage then broadcasts the outcome over the pipeline
group, and every rank raises the same `PipelineConfigError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import all_gather_flat
from cx_pipeline._calling import call_arguments, check_stage_output, signature_problem
from cx_pipeline._errors import PipelineConfigError
from cx_pipeline._p2p import StageTransport
from cx_pipeline._pytree import flatten
from cx_pipeline._stage_manager import PipelineStageManager

__all__ = ["AGREE_STEPS", "agree_to_probe", "batch_signature", "probe"]

#: Steps at the start that always agree on probing; later steps agree only when a stage's batch changed.
AGREE_STEPS = 3


def batch_signature(value: Any) -> str:
    """Structure, shapes and dtypes of a micro-batch: the probe reruns when this changes."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{batch_signature(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(batch_signature(v) for v in value) + "]"
    return type(value).__name__


def agree_to_probe(manager: PipelineStageManager, device: torch.device, changed: bool, num_microbatches: int) -> bool:
    """Whether every stage probes this step: yes when any stage's batch signature changed. Decided together (one
    small all-gather over the pipeline group) because each stage sees only its own batch: stages deciding alone
    would probe at different steps and wait for each other forever. Stages splitting their batches into different
    numbers of micro-batches would run different schedules and hang; that is refused here, naming every stage's.

    Called on the first `AGREE_STEPS` steps and then only when this stage's batch fingerprint changed (`_schedule`):
    the all-gather and its read are off the steady-state step (issue 37)."""
    mine = torch.tensor([int(changed), num_microbatches], dtype=torch.int64, device=device)
    everyone = torch.empty(2 * manager.num_stages, dtype=torch.int64, device=device)
    all_gather_flat(everyone, mine, group=manager.pp_group)
    rows = everyone.view(-1, 2).tolist()
    stage_of = {rank: stage for stage, rank in enumerate(manager.stage_ranks)}
    counts = {stage_of[dist.get_global_rank(manager.pp_group, i)]: row[1] for i, row in enumerate(rows)}
    if len(set(counts.values())) > 1:
        described = ", ".join(f"stage {stage}: {counts[stage]}" for stage in sorted(counts))
        raise PipelineConfigError(
            f"the pipeline stages split this step's batch into different numbers of micro-batches ({described}); "
            "every stage must get a batch of the same size (the same batch, e.g. from the same data loader and seed)"
        )
    return any(row[0] for row in rows)


def _run_stage(
    manager: PipelineStageManager,
    chunk: nn.Module,
    chunk_id: int,
    virtual: int,
    micro_batch: Any,
    received: Mapping[str, Any],
    criterion: Callable[[Any, Any], torch.Tensor],
) -> tuple[Any, str | None]:
    where = f"virtual stage {virtual} (pipeline stage {manager.stage}, chunk {chunk_id})"
    last = virtual == manager.num_virtual_stages - 1
    try:
        args, kwargs = call_arguments(micro_batch, received)
        problem = signature_problem(chunk, args, kwargs)
        if problem is not None:
            sent = sorted(received)
            return None, (
                f"{where} does not take what it is given: the micro-batch plus {sent} from virtual stage "
                f"{virtual - 1}. {problem}"
            )
        with torch.no_grad(), manager.switch_model_chunk_id(chunk_id):
            output = chunk(*args, **kwargs)
            if not last:
                problem = check_stage_output(output)
                if problem is not None:
                    return None, f"{where} cannot feed virtual stage {virtual + 1}: {problem}"
                flatten(output, f"the output of {where}")
                return output, None
            loss = criterion(output, micro_batch)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                return None, f"criterion(outputs, micro_batch) must return a one-element tensor, got {type(loss)}"
            return output, None
    except Exception as error:  # reported on every rank below, instead of leaving the others waiting
        return None, f"{where} raised {type(error).__name__}: {error}"


def probe(
    manager: PipelineStageManager,
    transport: StageTransport,
    chunks: Sequence[nn.Module],
    micro_batch: Any,
    criterion: Callable[[Any, Any], torch.Tensor] | None,
) -> None:
    """Run the probe forward; on success `transport.act_meta` holds every incoming edge's metadata."""
    num_virtual = manager.num_virtual_stages
    me = manager.stage
    transport.unsettle()
    local: dict[int, tuple[Any, str | None]] = {}
    outcome: str | None = None
    check_loss = criterion if criterion is not None else (lambda _out, _mb: torch.zeros(()))
    for virtual in range(num_virtual):
        stage, chunk_id = manager.locate_virtual_stage(virtual)
        if stage != me:
            continue
        error: str | None = None
        received: Any = {}
        if virtual > 0:
            previous = manager.locate_virtual_stage(virtual - 1)[0]
            if previous == me:
                received, error = local.pop(virtual)
            else:
                received, _, error = transport.probe_receive(previous, virtual)
        output = None
        if error is None:
            output, error = _run_stage(manager, chunks[chunk_id], chunk_id, virtual, micro_batch, received, check_loss)
        if virtual == num_virtual - 1:
            outcome = error
            continue
        following = manager.locate_virtual_stage(virtual + 1)[0]
        if following == me:
            if error is None:
                transport.act_meta[virtual + 1] = flatten(output)[1]
            local[virtual + 1] = (output, error)
        else:
            transport.probe_send(following, virtual + 1, output, error)
    transport.wait_all()
    _share_outcome(manager, transport, outcome)


def _share_outcome(manager: PipelineStageManager, transport: StageTransport, outcome: str | None) -> None:
    last_stage = manager.locate_virtual_stage(manager.num_virtual_stages - 1)[0]
    source = manager.rank_of_stage(last_stage)
    data = (outcome or "").encode()
    size = torch.tensor([len(data)], dtype=torch.int64, device=transport.device)
    dist.broadcast(size, source, group=manager.pp_group)
    if int(size.item()) == 0:
        return
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=transport.device)
    if manager.stage == last_stage:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, source, group=manager.pp_group)
    raise PipelineConfigError("pipeline check failed: " + bytes(buffer.tolist()).decode())
