"""A ColossalAI Llama benchmark-style script (examples/language/llama/benchmark.py's shape) with only its imports
changed to cx: launch_from_torch, get_accelerator, HybridAdam, GeminiPlugin with gradient checkpointing, a cosine
warm-up scheduler, clip_grad_by_norm, parameter counting and a sharded checkpoint that loads back.
Run under torchrun by tests/test_colossalai_example_flows.py; prints one JSON line on rank 0."""

import json
import os
import sys
from typing import Any

import torch
import transformers

from cx_mesh import get_accelerator, get_dist_logger, launch_from_torch
from cx_plugins import Booster, GeminiPlugin, LowLevelZeroPlugin
from cx_plugins.lr_scheduler import CosineAnnealingWarmupLR
from cx_zero import HybridAdam


def main(plugin_name: str, out_dir: str) -> None:  # a ColossalAI-style script: loosely typed on purpose
    launch_from_torch(seed=42)
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
    model: Any = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable()
    n_params = sum(p.numel() for p in model.parameters())
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
    optimizer: Any = HybridAdam(model.parameters(), lr=1e-2, weight_decay=0.0)
    scheduler: Any = CosineAnnealingWarmupLR(optimizer, total_steps=16, warmup_steps=2)
    model, optimizer, _, _, scheduler = booster.boost(model, optimizer, lr_scheduler=scheduler)
    assert sum(p.numel() for p in model.parameters()) == n_params, "parameter count after boost"
    generator = torch.Generator().manual_seed(0)
    data = torch.randint(0, 128, (4, 32), generator=generator)  # one batch, learnt by heart
    rank = int(os.environ["RANK"])
    mine = data[rank * 2 : rank * 2 + 2].to(accelerator.get_current_device())
    losses = []
    for _ in range(16):
        outputs = model(input_ids=mine, labels=mine)
        booster.backward(outputs.loss, optimizer)
        optimizer.clip_grad_by_norm(1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(outputs.loss))
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
    fresh, optimizer_2, *_ = booster_2.boost(fresh, optimizer_2)
    booster_2.load_model(fresh, os.path.join(out_dir, "model"))
    booster_2.load_optimizer(optimizer_2, os.path.join(out_dir, "optimizer"))
    with torch.no_grad():
        reloaded = float(fresh(input_ids=mine, labels=mine).loss)
        trained = float(model(input_ids=mine, labels=mine).loss)
    if rank == 0:
        print(json.dumps({"first": losses[0], "last": losses[-1], "trained": trained, "reloaded": reloaded}))
    sys.stdout.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
