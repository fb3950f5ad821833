"""One rank of the demo: build the model, boost it with the chosen plugin, train, report progress on rank 0."""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.distributed as dist

from cx_mesh import all_gather_flat, get_accelerator, launch_from_torch
from cx_plugins._booster import Booster
from cx_plugins._gemini_plugin import GeminiPlugin
from cx_plugins._hybrid_plugin import HybridParallelPlugin
from cx_plugins._low_level_zero_plugin import LowLevelZeroPlugin
from cx_plugins._plugin import DPPluginBase, Plugin
from cx_plugins._torch_ddp_plugin import TorchDDPPlugin
from cx_plugins.demo._checkpointing import TrainerState, load_checkpoint, save_checkpoint
from cx_plugins.demo._data import TokenWindows
from cx_plugins.demo._options import DemoOptions
from cx_plugins.models import GPT, GPTConfig

__all__ = ["train"]


def _plugin_and_precision(options: DemoOptions) -> tuple[Plugin, str | None]:
    if options.plugin == "torch_ddp":
        return TorchDDPPlugin(), None if options.precision == "fp32" else options.precision
    if options.plugin == "gemini":
        # The demo model is small: small chunks, so that its parameters really are sharded over the ranks.
        return GeminiPlugin(precision=options.precision, search_range_m=1, min_chunk_size_m=0.05, hidden_dim=64), None
    if options.plugin == "low_level_zero":
        return LowLevelZeroPlugin(stage=2, precision=options.precision), None
    if options.plugin == "hybrid":
        microbatches = math.gcd(options.batch_size, 2 * options.pp) if options.pp > 1 else None
        plugin = HybridParallelPlugin(
            tp_size=options.tp, pp_size=options.pp, precision=options.precision, num_microbatches=microbatches
        )
        return plugin, None
    raise ValueError(f"unknown plugin {options.plugin!r}")


def _memory_per_rank() -> list[int]:
    mine = torch.tensor([get_accelerator().memory_allocated()], dtype=torch.int64)
    everyone = torch.empty(dist.get_world_size(), dtype=torch.int64)
    all_gather_flat(everyone, mine)
    return [int(v) for v in everyone]


def train(options: DemoOptions) -> list[float]:
    """Run the demo on this rank (torch.distributed from torchrun's environment); returns rank 0's losses."""
    launch_from_torch(seed=options.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = TokenWindows(n_windows=max(512, options.batch_size * world * 16), length=options.seq_len + 1)
    config = GPTConfig(
        vocab_size=dataset.tokenizer.vocab_size,
        max_positions=options.seq_len + 1,
        hidden_size=options.hidden_size,
        num_layers=options.num_layers,
        num_heads=4,
    )
    plugin, mixed_precision = _plugin_and_precision(options)
    booster = Booster(mixed_precision=mixed_precision, plugin=plugin)
    model = GPT(config, seed=options.seed)
    parameters = sum(p.numel() for p in model.parameters())  # before boosting: Gemini shards them away
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.lr, weight_decay=0.0)
    loader = plugin.prepare_dataloader(dataset, batch_size=options.batch_size, shuffle=True, seed=options.seed)
    boosted, boosted_optimizer, *_ = booster.boost(model, optimizer)
    assert boosted_optimizer is not None
    if rank == 0:
        print(
            f"cx-train: plugin={options.plugin} ranks={world} precision={options.precision} "
            f"params={parameters / 1e6:.2f}M steps={options.steps}",
            flush=True,
        )
    losses: list[float] = []
    device = get_accelerator().current_device()
    step = 0
    if options.resume is not None:
        step = load_checkpoint(booster, boosted, boosted_optimizer, options.resume).step
        if rank == 0:
            print(f"cx-train: resumed from {options.resume} at step {step}", flush=True)
    data_parallel_size = plugin.data_parallel_rank_and_size()[1] if isinstance(plugin, DPPluginBase) else world
    epoch, skip = divmod(step, len(loader))
    started, tokens = time.perf_counter(), 0
    while step < options.steps:
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        for index, batch in enumerate(loader):
            if index < skip:  # resuming mid-epoch: the batches before the checkpoint were already trained on
                continue
            batch = batch.to(device)
            loss: torch.Tensor | None
            if plugin.supports_pipeline():  # the loss exists on the last stage only
                data = {"input_ids": batch, "labels": batch}
                loss = booster.execute_pipeline(iter([data]), boosted, _loss_is_output, boosted_optimizer)["loss"]
            else:
                loss = boosted(batch, labels=batch)
                booster.backward(loss, boosted_optimizer)
            boosted_optimizer.step()
            boosted_optimizer.zero_grad()
            losses.append(_mean_over_holders(loss, device))
            tokens += batch.numel() * data_parallel_size
            step += 1
            if step % options.log_every == 0 or step == options.steps:
                _report(step, options.steps, losses, tokens / (time.perf_counter() - started), _memory_per_rank())
            if options.save is not None and (
                step == options.steps or (options.save_every and step % options.save_every == 0)
            ):
                state = TrainerState(step=step, plugin=options.plugin, world_size=world)
                save_checkpoint(booster, boosted, boosted_optimizer, options.save, state)
                if rank == 0:
                    print(f"cx-train: saved step {step} to {options.save}", flush=True)
            if step >= options.steps:
                break
        epoch, skip = epoch + 1, 0
    return losses


def _loss_is_output(loss: torch.Tensor, _micro_batch: object) -> torch.Tensor:
    return loss  # the reference GPT's last stage returns its loss


def _mean_over_holders(loss: torch.Tensor | None, device: torch.device) -> float:
    """The mean loss over the ranks that hold one (all ranks, or the last pipeline stage's)."""
    value = torch.tensor([0.0 if loss is None else float(loss.detach()), 0.0 if loss is None else 1.0], device=device)
    dist.all_reduce(value)
    return float(value[0] / value[1])


def _report(step: int, total: int, losses: list[float], tokens_per_second: float, memory: list[int]) -> None:
    if dist.get_rank() != 0:
        return
    width = 24
    filled = int(width * step / total)
    recent = sum(losses[-10:]) / len(losses[-10:])
    memory_text = " ".join(f"r{r}:{m / 2**20:.0f}MiB" for r, m in enumerate(memory))
    line = f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{total} loss {recent:.3f} "
    line += f"tok/s {tokens_per_second:,.0f} mem {memory_text}"
    print(line, file=sys.stdout, flush=True)
