"""ColossalAI's Gemini tests build GeminiDDP from an edited search result:
`config_dict, *_ = search_chunk_configuration(model, search_range_m=1, search_interval=100)`, then
`config_dict[world_size]["chunk_size"] = 5000` and `GeminiDDP(model, config_dict, ...)`. The same lines train like
PyTorch data parallelism with cx."""

from __future__ import annotations

import torch
from torch import nn

from cx_chunk import search_chunk_configuration
from cx_mesh.testing import distributed
from cx_zero.gemini import GeminiDDP, GeminiOptimizer
from zero_gemini_helpers import Reference, assert_state_close, make_gpt, train_step

RTOL, ATOL = 1e-5, 1e-6


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@distributed(world_size=2)
def test_zero_gemini_from_colossalai_search_snippet(rank: int, world_size: int) -> None:
    reference = Reference(make_gpt(), world_size, _adamw)
    model = make_gpt()
    config_dict, *_ = search_chunk_configuration(model, search_range_m=1, search_interval=100)
    config_dict[world_size]["chunk_size"] = 5000
    config_dict[world_size]["keep_gathered"] = False
    ddp = GeminiDDP(model, config_dict, mixed_precision=torch.float32)
    assert ddp.chunk_config.chunk_size == 5000
    assert not ddp.chunk_config.keep_gathered
    assert {c.chunk_size for c in ddp.manager.chunks()} >= {5000}
    optimizer = GeminiOptimizer(_adamw(list(ddp.parameters())), ddp)
    for step in range(2):
        train_step(ddp, optimizer, rank, world_size, step)
        reference.step(step)
        assert_state_close(ddp.state_dict(only_rank_0=False), reference.state(), RTOL, ATOL, f"step {step}")
