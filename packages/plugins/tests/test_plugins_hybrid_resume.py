"""HybridParallelPlugin checkpoints through the Booster: saved at one layout (tp 2 or pp 2), loaded at another
(pp 2, tp 2, dp 2 with ZeRO-2) or into LowLevelZeroPlugin, training continues and matches an uninterrupted
single-process run (AdamW, so the optimizer state by name matters); the saved folder loads with transformers'
`from_pretrained` as the single-process model at the save step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from cx_mesh.testing import TEST_ADAM_EPS, run_distributed, tiny_model_adam_tolerance
from cx_plugins import Booster, HybridParallelModule, HybridParallelPlugin, LowLevelZeroPlugin, ModelWrapper, Plugin
from hybrid_test_helpers import BATCH, LENGTH, batch, compare_parameters, llama

transformers = pytest.importorskip("transformers")

SAVE_AT, STEPS, LR = 3, 5, 1e-2
# AdamW at TEST_ADAM_EPS keeps each step a smooth function of the gradient (at the default eps a near-zero gradient's
# rounding decides the sign of an lr-sized step); the parameters then differ by rounding alone, bounded from it
ATOL = tiny_model_adam_tolerance(LR, STEPS, tokens=BATCH * LENGTH)

PLUGINS: dict[str, Callable[[], Plugin]] = {
    "tp2_zero1": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32", zero_stage=1),
    "pp2_zero0": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, precision="fp32", num_microbatches=2),
    "dp2_zero2": lambda: HybridParallelPlugin(tp_size=1, pp_size=1, precision="fp32", zero_stage=2),
    "low_level_zero": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
}


def _about(name: str) -> Callable[[str], str]:
    """assert_close's message with the parameter's name in front of torch's own (which shows the difference)."""
    return lambda message: f"{name}: {message}"


def _reference(steps: int) -> nn.Module:
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS)
    for step in range(steps):
        model(**batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _phase(rank: int, world_size: int, kind: str, directory: str, load: bool) -> None:
    plugin = PLUGINS[kind]()
    model = llama()
    if load:
        with torch.no_grad():  # another starting point: only the checkpoint can bring it back
            for param in model.parameters():
                param.mul_(0.5)
    booster = Booster(plugin=plugin)
    boosted, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=LR, eps=TEST_ADAM_EPS))
    assert optimizer is not None
    if load:
        booster.load_model(boosted, Path(directory, "model"))
        booster.load_optimizer(optimizer, Path(directory, "optimizer"))
    dp_rank, dp_size = plugin.data_parallel_rank_and_size()  # type: ignore[attr-defined]
    share = BATCH // dp_size
    for step in range(SAVE_AT, STEPS) if load else range(SAVE_AT):
        mine = {k: v[dp_rank * share : (dp_rank + 1) * share] for k, v in batch(step).items()}
        if isinstance(plugin, HybridParallelPlugin) and plugin.pp_size > 1:
            booster.execute_pipeline(iter([mine]), boosted, lambda out, _: out.loss, optimizer)
        else:
            booster.backward(boosted(**mine).loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    if not load:
        booster.save_model(boosted, Path(directory, "model"), shard=True)
        booster.save_optimizer(optimizer, Path(directory, "optimizer"), shard=True)
        return
    reference = _reference(STEPS)
    if isinstance(boosted, HybridParallelModule):
        assert isinstance(plugin, HybridParallelPlugin)
        compare_parameters(boosted, reference, plugin, rtol=0, atol=ATOL)
    else:
        expected = dict(reference.named_parameters())
        assert isinstance(boosted, ModelWrapper)
        for name, param in boosted.unwrap().named_parameters():
            torch.testing.assert_close(param.detach(), expected[name].detach(), rtol=0, atol=ATOL, msg=_about(name))
    dist.barrier()


@pytest.mark.parametrize(
    ("saver", "loader"),
    [
        ("tp2_zero1", "pp2_zero0"),
        ("pp2_zero0", "tp2_zero1"),
        ("tp2_zero1", "dp2_zero2"),
        ("pp2_zero0", "low_level_zero"),
    ],
)
def test_plugins_hybrid_resume_across_layouts(tmp_path: Path, saver: str, loader: str) -> None:
    run_distributed(_phase, 2, kind=saver, directory=str(tmp_path), load=False)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    expected = dict(_reference(SAVE_AT).named_parameters())
    for name, param in loaded.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name].detach(), rtol=0, atol=ATOL, msg=_about(name))
    run_distributed(_phase, 2, kind=loader, directory=str(tmp_path), load=True)
