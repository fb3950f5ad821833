"""One rank of cx-train: build the model, boost it with the chosen plugin, train, report progress on rank 0."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from cx_mesh import get_accelerator, launch_from_torch
from cx_plugins import Booster, OptimizerWrapper
from cx_train.checkpoint._checkpointing import TrainerState, load_checkpoint
from cx_train.checkpoint._restart import note_reached, restart_line
from cx_train.checkpoint._run_saves import RunSaves
from cx_train.checkpoint._save_lock import save_folder_lock
from cx_train.config._config_file import resolved_toml
from cx_train.config._options import TrainOptions
from cx_train.config._resumed_model import schedule_note
from cx_train.data._grammar import TokenWindows
from cx_train.data._packing import PackedBatch
from cx_train.data._user_loader import open_loader
from cx_train.metrics._memory import memory_per_rank
from cx_train.metrics._mfu import active_parameters, flops_per_token, peak_flops
from cx_train.metrics._progress import Progress, StepOutput, batch_targets, expert_counts
from cx_train.metrics._reporting import Reporting
from cx_train.models._lora import ADAPTER_FOLDER, lora_config
from cx_train.models._plugins import make_plugin
from cx_train.models._spec import DescribedModel, build_model, describe_model
from cx_train.models._tokenizer_files import tokenizer_identity
from cx_train.step._grad_norm import clip_bound
from cx_train.step._interrupt import Interrupted, stop_requested
from cx_train.step._optimization import make_optimizer, make_scheduler, micro_step, prepare_model

__all__ = ["run", "train"]


def _pipeline_step(
    booster: Booster,
    model: torch.nn.Module,
    optimizer: OptimizerWrapper,
    batch: torch.Tensor | PackedBatch,
    described: DescribedModel,
) -> StepOutput:
    """One step through the plugin's pipeline schedule (ColossalAI's `execute_pipeline`). The loss is on the last
    stage only; so are the MoE numbers, which the criterion reads off each micro-batch's outputs there (the router
    logits of every layer travel to the last stage for the aux loss)."""
    aux: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []

    def criterion(outputs: Any, inputs: Any) -> torch.Tensor:
        if getattr(outputs, "aux_loss", None) is not None:
            aux.append(outputs.aux_loss.detach())
        if described.num_experts > 0 and getattr(outputs, "router_logits", None):
            counts.append(expert_counts(outputs.router_logits, described.top_k))
        return cast(torch.Tensor, getattr(outputs, "loss", outputs))

    if isinstance(batch, PackedBatch):  # every stage (HF or cx's GPT) masks the documents from the position ids
        one = {"input_ids": batch.input_ids, "labels": batch.labels, "position_ids": batch.position_ids}
    else:
        one = {"input_ids": batch, "labels": batch}
    inputs: Iterator[dict[str, torch.Tensor]] = iter([one])
    result = booster.execute_pipeline(inputs, model, criterion, optimizer, return_loss=True)
    loss = result.get("loss") if isinstance(result, dict) else None
    return StepOutput(
        loss,
        torch.stack(aux).mean() if aux else None,
        torch.stack(counts).sum(dim=0) if counts else None,
        targets=float(batch_targets(batch)),
    )


def train(options: TrainOptions) -> list[float]:
    """Run cx-train on this rank (torch.distributed from torchrun's environment); returns the step losses."""
    launch_from_torch(seed=options.seed, timeout=timedelta(seconds=options.timeout))  # every group cx makes too
    return run(options)


def run(options: TrainOptions) -> list[float]:
    """cx-train on this rank of an initialised process group; returns the step losses (mean over the ranks).
    Raises `Interrupted` on every rank at the same step when any rank was asked to stop (Ctrl-C). Rank 0 holds the
    `--save` folder for the whole run, so a second run saving there stops before its first step; no background write
    of this run outlives it."""
    with save_folder_lock(options.save, master=dist.get_rank() == 0), contextlib.ExitStack() as on_exit:
        return _run(options, on_exit)


def _run(options: TrainOptions, on_exit: contextlib.ExitStack) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    described = describe_model(options.model_spec)
    # the model shifts the labels itself, so a window is --seq-len + 1 tokens; under sequence parallelism the window
    # is the sequence that splits into --sp equal shards, so it is --seq-len tokens (validated as a multiple of --sp)
    dataset = TokenWindows(
        n_windows=max(512, options.batch_size * world * 16),
        length=options.window_length,
        tokenizer=described.tokenizer,
    )
    model = prepare_model(build_model(described, seed=options.seed), options, described.spec.is_hf)
    plugin, mixed_precision = make_plugin(options, model)  # torch_fsdp wraps the model's decoder layers
    booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    if options.lora is not None:  # the adapters alone train: resumed from the checkpoint's, or new
        adapters = None if options.resume is None else options.resume / ADAPTER_FOLDER
        config = None if adapters is not None else lora_config(options.lora)
        model = booster.enable_lora(model, pretrained_dir=adapters, lora_config=config)
    parameters = sum(p.numel() for p in model.parameters())  # before boosting: Gemini shards them away
    model_name = type(model).__name__  # before boosting: FSDP2 renames the class
    model_flops = flops_per_token(active_parameters(model, described.num_experts, described.top_k))
    optimizer = make_optimizer(model, options)
    scheduler = make_scheduler(optimizer, options)
    user_data = None if options.data is None else open_loader(options, plugin)  # --data (_user_loader)
    loader = (
        user_data
        if user_data is not None
        else plugin.prepare_dataloader(dataset, batch_size=options.batch_size, shuffle=True, seed=options.seed)
    )
    boosted, boosted_optimizer, *_ = booster.boost(model, optimizer, lr_scheduler=scheduler)
    assert boosted_optimizer is not None
    if rank == 0:
        print(
            f"cx-train: model={options.model} ({model_name}) plugin={options.plugin} ranks={world} "
            f"precision={options.precision} params={parameters / 1e6:.2f}M steps={options.steps}",
            flush=True,
        )
        if user_data is not None:
            print(user_data.data.summary(), flush=True)
    device = get_accelerator().current_device()
    tokenizer = tokenizer_identity(described.tokenizer)  # recorded with each checkpoint: --resume compares it
    step = 0
    saves = RunSaves(
        booster, boosted, boosted_optimizer, options.save, scheduler, rank == 0, described.tokenizer, options.lora
    )
    on_exit.callback(saves.wait_for_writes)  # before the --save lock is released, an error included
    if options.resume is not None:
        step = load_checkpoint(booster, boosted, boosted_optimizer, options.resume, scheduler).step
        if rank == 0 and not options.restart:
            print(f"cx-train: resumed from {options.resume} at step {step}", flush=True)
            note = schedule_note(options.resume, options.lr_schedule, options.steps)
            if note is not None:
                print(note, flush=True)
    if rank == 0 and options.restart:
        print(restart_line(options, step, options.data_parallel_size(world)), flush=True)
    peak = peak_flops(device, options.precision)
    progress = Progress(options.steps, device, options.pp > 1, step, model_flops, peak and peak * world)
    resumed_at = step if options.resume is not None or options.restart else None  # later lines are trained again
    reporting = Reporting(options.metrics, options.tensorboard, resumed_at, rank == 0)
    data_parallel = options.data_parallel_size(world)
    epoch, skip = divmod(step * options.grad_accum, len(loader))  # batches consumed: grad_accum per step
    pending: list[torch.Tensor | PackedBatch] = []  # the micro-batches of the next optimizer step
    while step < options.steps:
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index < skip:  # resuming mid-epoch: the batches before the checkpoint were already trained on
                continue
            pending.append(batch.to(device))
            if len(pending) < options.grad_accum:
                continue
            batches, pending = pending, []
            # --clip, or at a log step a bound that only measures the gradient norm (collective, so not every step)
            bound = clip_bound(options.clip, (step + 1) % options.log_every == 0 or step + 1 == options.steps)
            if options.pp > 1:
                output = _pipeline_step(booster, boosted, boosted_optimizer, batches[0], described)
                if bound > 0:
                    norm = boosted_optimizer.clip_grad_by_norm(bound)
                    output = replace(output, grad_norm=torch.as_tensor(norm))
                boosted_optimizer.step()
                boosted_optimizer.zero_grad()
            else:
                output = micro_step(booster, boosted, boosted_optimizer, batches, described, bound)
            scheduler.step()
            if rank == 0:
                note_reached(options, step + 1)
            stopping = progress.record(output, sum(b.numel() for b in batches) * data_parallel, stop_requested())
            step += 1
            if user_data is not None:  # before the log line, which reports this evaluation
                user_data.maybe_evaluate(boosted, described, step, device)
                if user_data.last_eval is not None and user_data.last_eval.step == step:
                    progress.note_eval(step, user_data.last_eval.loss)
            if step % options.log_every == 0 or step == options.steps:
                lr = float(boosted_optimizer.param_groups[0]["lr"])
                grad_norm = None if output.grad_norm is None else float(output.grad_norm)
                reporting.write(progress.report(step, memory_per_rank(), lr, grad_norm))
            if options.save is not None and (
                step == options.steps or (options.save_every and step % options.save_every == 0)
            ):
                built_in = not options.model_spec.is_folder  # a folder has its own sizes
                state = TrainerState(
                    step,
                    options.plugin,
                    world,
                    options.model,
                    hidden_size=options.hidden_size if built_in else None,
                    num_layers=options.num_layers if built_in else None,
                    tokenizer=tokenizer,
                    optimizer=options.optimizer,
                )
                state = state if user_data is None else user_data.with_position(state)
                config = resolved_toml(dict(options.resolved), header=f"cx-train's resolved config (step {step})")
                saves.save(state, config, final=step == options.steps)  # --save-every: in the background
            if stopping and step < options.steps:  # every rank agreed in progress.record; a due save is done
                raise Interrupted(step, options.steps, saves.finish(), options.save)
            if step >= options.steps:
                break
        epoch, skip = epoch + 1, 0
    reporting.close()
    return progress.losses
