"""Step `gemini_offload`: one process trains a small GPT for a few steps with GeminiPlugin placing everything it can
on the host (static placement, shard_param_frac = offload_optim_frac = offload_param_frac = 1.0: fp32 masters,
gradients, optimizer state and the released parameter shards live in CPU memory, the forward and backward on the
GPU), and its losses must match a plain single-process PyTorch run of the same model and data on the same device.

fp32 and SGD with momentum, as in cx-zero's Gemini GPU tests: the two runs then differ by kernel rounding only (the
offloaded optimizer steps on the CPU, the reference's on the GPU), far inside LOSS_RTOL; Adam's sign-like update
would turn a near-zero gradient's rounding into an lr-sized step. On a machine without CUDA the same code runs on the
CPU, where host and device are one memory, so only the parity is checked.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cx_mesh import get_accelerator, launch
from cx_mesh.testing import free_port
from cx_plugins import Booster, GeminiPlugin
from cx_plugins.models import GPT, GPTConfig
from cx_zero.gemini import GeminiDDP
from gpu_check_step import run_step

STEPS, BATCH, LENGTH = 3, 4, 16
LOSS_RTOL = 1e-4  # equal on a CPU; on a GPU the host-side optimizer step rounds apart from the reference's


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def main() -> str:
    launch(0, 1, "127.0.0.1", free_port(), local_rank=0, verbose=False)
    try:
        device = get_accelerator().current_device()
        config = GPTConfig(vocab_size=128, max_positions=LENGTH, hidden_size=64, num_layers=2, num_heads=4)
        generator = torch.Generator().manual_seed(0)
        batches = torch.randint(0, config.vocab_size, (STEPS, BATCH, LENGTH), generator=generator).to(device)

        reference = GPT(config, seed=0).to(device)
        optimizer = _sgd(reference)
        expected = []
        for batch in batches:
            loss = reference(batch, labels=batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            expected.append(loss.item())

        plugin = GeminiPlugin(
            precision="fp32",
            placement_policy="static",
            shard_param_frac=1.0,
            offload_optim_frac=1.0,
            offload_param_frac=1.0,
            chunk_config_dict={"chunk_size": 16384},  # several chunks for this model
        )
        booster = Booster(plugin=plugin)
        plain = GPT(config, seed=0)
        model, boosted_optimizer, *_ = booster.boost(plain, _sgd(plain))
        assert boosted_optimizer is not None
        losses = []
        for batch in batches:
            loss = model(batch, labels=batch)
            booster.backward(loss, boosted_optimizer)
            boosted_optimizer.step()
            boosted_optimizer.zero_grad()
            losses.append(loss.item())

        ddp = model.ddp  # the boosted model's engine
        assert isinstance(ddp, GeminiDDP)
        usage = ddp.manager.usage
        for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
            if abs(got - want) > LOSS_RTOL * abs(want):
                raise AssertionError(f"step {step}: Gemini loss {got:.6f}, PyTorch {want:.6f} (rtol {LOSS_RTOL})")
        if device.type == "cuda" and usage.host <= usage.device:
            raise AssertionError(f"offload: chunks hold {usage.device} B on the GPU, only {usage.host} B on the host")
        drift = max(abs(g - w) / abs(w) for g, w in zip(losses, expected, strict=True))
        return (
            f"{device.type}: losses {', '.join(f'{x:.4f}' for x in losses)} match PyTorch's within {drift:.1e} "
            f"(rtol {LOSS_RTOL}); chunk memory {usage.device / 2**20:.2f} MiB device, {usage.host / 2**20:.2f} MiB host"
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_step(main)
