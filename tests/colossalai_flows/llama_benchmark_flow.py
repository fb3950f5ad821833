"""A ColossalAI Llama benchmark-style script (examples/language/llama/benchmark.py's shape) with only its imports
changed to cx: launch_from_torch, DistCoordinator, get_accelerator, the model built under LazyInitContext for Gemini
(materialised at boost), gradient checkpointing, a random dict dataset through plugin.prepare_dataloader, bf16 as
the default dtype around boost, HybridAdam, a cosine warm-up scheduler, clip_grad_by_norm, parameter counting, the
memory lines, and a sharded checkpoint (model, optimizer, scheduler) that loads back.
Run under torchrun by tests/test_colossalai_example_flows.py; prints one JSON line on rank 0."""

import contextlib
import json
import os
import sys
from typing import Any

import torch
import transformers

from cx_mesh import DistCoordinator, get_accelerator, get_dist_logger, launch_from_torch
from cx_plugins import Booster, GeminiPlugin, LazyInitContext, LowLevelZeroPlugin
from cx_plugins.lr_scheduler import CosineAnnealingWarmupLR
from cx_zero import HybridAdam


class RandomDataset(torch.utils.data.Dataset[dict[str, Any]]):  # benchmark.py's: random tokens as input_ids and labels
    def __init__(self, num_samples: int, max_length: int, vocab_size: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.input_ids = torch.randint(0, vocab_size, (num_samples, max_length), generator=generator)
        self.attention_mask = torch.ones_like(self.input_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, idx: int) -> dict[str, Any]:
        return {
            "input_ids": self.input_ids[idx],
            "attention_mask": self.attention_mask[idx],
            "labels": self.input_ids[idx],
        }


def main(plugin_name: str, out_dir: str) -> None:  # a ColossalAI-style script: loosely typed on purpose
    launch_from_torch(seed=42)
    coordinator = DistCoordinator()
    logger = get_dist_logger()
    accelerator = get_accelerator()
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    init_ctx: Any = (
        LazyInitContext(default_device=accelerator.get_current_device())
        if plugin_name == "gemini"
        else contextlib.nullcontext()
    )
    with init_ctx:
        model: Any = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in model.parameters())
    coordinator.print_on_master(f"Model params: {n_params / 1e6:.2f} M")
    plugin: Any
    if plugin_name == "gemini":
        plugin = GeminiPlugin(
            precision="bf16",
            placement_policy="static",
            initial_scale=2**16,
            max_norm=1.0,
            enable_fused_normalization=accelerator.is_available(),
        )
    else:
        plugin = LowLevelZeroPlugin(stage=2, precision="bf16", max_norm=1.0)
    booster = Booster(plugin=plugin)
    # four samples, two per rank: each epoch is one batch per rank, so the model can learn it by heart
    dataset = RandomDataset(num_samples=4, max_length=32, vocab_size=128)
    dataloader: Any = plugin.prepare_dataloader(dataset, batch_size=2, shuffle=True, drop_last=True, seed=42)
    optimizer: Any = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler: Any = CosineAnnealingWarmupLR(optimizer, total_steps=16, warmup_steps=2)
    torch.set_default_dtype(torch.bfloat16)
    model, optimizer, _, dataloader, scheduler = booster.boost(
        model, optimizer, dataloader=dataloader, lr_scheduler=scheduler
    )
    torch.set_default_dtype(torch.float)
    assert sum(p.numel() for p in model.parameters()) == n_params, "parameter count after boost"
    coordinator.print_on_master(
        f"Booster init max device memory: {accelerator.max_memory_allocated() / 1024**2:.2f} MB"
    )
    losses = []
    for _ in range(16):
        for batch in dataloader:
            batch = {k: v.to(accelerator.get_current_device()) for k, v in batch.items()}
            outputs = model(**batch)
            booster.backward(outputs.loss, optimizer)
            optimizer.clip_grad_by_norm(1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            losses.append(float(outputs.loss))
    mine = batch["input_ids"]
    logger.info(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", ranks=[0])
    booster.save_model(model, os.path.join(out_dir, "model"), shard=True, size_per_shard=1)
    booster.save_optimizer(optimizer, os.path.join(out_dir, "optimizer"), shard=True, size_per_shard=1)
    booster.save_lr_scheduler(scheduler, os.path.join(out_dir, "scheduler.json"))
    fresh: Any = transformers.LlamaForCausalLM(config)
    booster_2 = Booster(
        plugin=GeminiPlugin(precision="bf16")
        if plugin_name == "gemini"
        else LowLevelZeroPlugin(stage=2, precision="bf16")
    )
    optimizer_2: Any = HybridAdam(fresh.parameters(), lr=3e-3)
    scheduler_2: Any = CosineAnnealingWarmupLR(optimizer_2, total_steps=16, warmup_steps=2)
    fresh, optimizer_2, _, _, scheduler_2 = booster_2.boost(fresh, optimizer_2, lr_scheduler=scheduler_2)
    booster_2.load_model(fresh, os.path.join(out_dir, "model"))
    booster_2.load_optimizer(optimizer_2, os.path.join(out_dir, "optimizer"))
    booster_2.load_lr_scheduler(scheduler_2, os.path.join(out_dir, "scheduler.json"))
    assert scheduler_2.get_last_lr() == scheduler.get_last_lr(), (scheduler_2.get_last_lr(), scheduler.get_last_lr())
    coordinator.print_on_master(f"Max device memory usage: {accelerator.max_memory_allocated() / 1024**2:.2f} MB")
    with torch.no_grad():
        reloaded = float(fresh(input_ids=mine, labels=mine).loss)
        trained = float(model(input_ids=mine, labels=mine).loss)
    if coordinator.is_master():
        print(json.dumps({"first": losses[0], "last": losses[-1], "trained": trained, "reloaded": reloaded}))
    sys.stdout.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
