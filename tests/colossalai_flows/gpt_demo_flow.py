"""A ColossalAI GPT demo-style script (examples/language/gpt/gemini/train_gpt_demo.py's shape) with only its imports
changed to cx: a GPT-2 LM wrapper built under LazyInitContext for Gemini, HybridAdam, a distplan switch between
Gemini, ZeRO-1/2 and DDP, a shifted cross-entropy criterion, random token data and the TFLOPS arithmetic from the
parameter count. Run under torchrun by tests/test_colossalai_example_flows.py; prints one JSON line on rank 0."""

import contextlib
import json
import os
import sys
import time
from typing import Any

import torch
import transformers
from torch import nn

from cx_mesh import get_accelerator, get_current_device, get_dist_logger, launch_from_torch
from cx_plugins import Booster, GeminiPlugin, LazyInitContext, LowLevelZeroPlugin, TorchDDPPlugin
from cx_zero import HybridAdam


class GPTLMModel(nn.Module):
    def __init__(self, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, max_seq_len: int = 32,
                 vocab_size: int = 128, checkpoint: bool = False) -> None:  # fmt: skip
        super().__init__()
        config = transformers.GPT2Config(
            n_embd=hidden_size, n_layer=num_layers, n_head=num_heads, n_positions=max_seq_len,
            vocab_size=vocab_size,
        )  # fmt: skip
        self.model = transformers.GPT2LMHeadModel(config)
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids: Any, attention_mask: Any) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]


class GPTLMLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = nn.CrossEntropyLoss()

    def forward(self, logits: Any, labels: Any) -> Any:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def get_data(batch_size: int, seq_len: int, vocab_size: int) -> Any:
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), device=get_current_device())
    attention_mask = torch.ones_like(input_ids)
    return input_ids, attention_mask


def main(distplan: str) -> None:  # a ColossalAI-style script: loosely typed on purpose
    launch_from_torch(seed=42)
    logger = get_dist_logger()
    batch_size, seq_len, vocab_size = 2, 32, 128
    ctx: Any = (
        LazyInitContext(default_device=get_accelerator().get_current_device())
        if distplan == "CAI_Gemini"
        else contextlib.nullcontext()
    )
    with ctx:
        model: Any = GPTLMModel(checkpoint=True)
    numel = sum(p.numel() for p in model.parameters())
    logger.info(f"the size of testing model size is {numel / 1e6:.3f}M.", ranks=[0])
    get_tflops = lambda model_numel, batch, seq, step_time: model_numel * batch * seq * 8 / 1e12 / (step_time + 1e-12)  # noqa: E731
    optimizer: Any = HybridAdam(model.parameters(), lr=3e-3)
    plugin: Any
    if distplan == "CAI_Gemini":
        plugin = GeminiPlugin(search_range_m=1, hidden_dim=64, min_chunk_size_m=0.01, precision="fp16",
                              initial_scale=2**5)  # fmt: skip
    elif distplan.startswith("CAI_ZeRO"):
        plugin = LowLevelZeroPlugin(stage=2 if distplan == "CAI_ZeRO2" else 1, initial_scale=2**5, precision="fp16")
    else:
        plugin = TorchDDPPlugin(find_unused_parameters=True)
    booster = Booster(plugin=plugin)
    boosted: Any = booster.boost(model, optimizer, criterion=GPTLMLoss())
    model, optimizer, criterion, _, _ = boosted
    assert sum(p.numel() for p in model.parameters()) == numel, "parameter count after boost"
    torch.manual_seed(123)  # the same data on every rank: the model learns it by heart
    data = [get_data(batch_size, seq_len, vocab_size) for _ in range(2)]
    losses, tflops = [], []
    for step in range(24):
        input_ids, attn_mask = data[step % 2]
        start = time.time()
        optimizer.zero_grad()
        outputs = model(input_ids, attn_mask)
        loss = criterion(outputs, input_ids)
        booster.backward(loss, optimizer)
        optimizer.step()
        get_accelerator().synchronize()
        tflops.append(get_tflops(numel, batch_size, seq_len, time.time() - start))
        losses.append(float(loss))
    logger.info(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}", ranks=[0])
    if int(os.environ["RANK"]) == 0:
        print(json.dumps({"first": losses[0], "last": losses[-1], "numel": numel, "tflops": tflops[-1]}))
    sys.stdout.flush()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
