"""ColossalAI-style example flows on cx, end to end on 2 CPU processes under torchrun: a Llama benchmark-style run
(lazy init under Gemini, gradient checkpointing, a prepared dataloader, bf16 as default dtype around boost,
HybridAdam, cosine warm-up, clipping) under Gemini and LowLevelZero, which must learn (loss falls), count parameters
as before boost, and save a checkpoint that loads back to the same loss and learning rate; and a GPT
demo-style run (LazyInitContext, fp16, a distplan switch) that must learn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cx_mesh.testing import free_port

pytest.importorskip("transformers")

FLOWS = Path(__file__).parent / "colossalai_flows"
FLOW = FLOWS / "llama_benchmark_flow.py"
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}


def _torchrun(script: Path, *args: str) -> dict[str, float]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(script), *args,
    ]  # fmt: skip
    result = subprocess.run(command, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(text for text in result.stdout.splitlines() if text.startswith("{"))
    figures: dict[str, float] = json.loads(line)
    return figures


@pytest.mark.parametrize("plugin", ["gemini", "low_level_zero"])
def test_llama_benchmark_style_flow(plugin: str, tmp_path: Path) -> None:
    figures = _torchrun(FLOW, plugin, str(tmp_path))
    assert figures["last"] < 0.6 * figures["first"], figures  # it learns the batch
    assert abs(figures["reloaded"] - figures["trained"]) < 1e-2 * figures["trained"] + 1e-4, figures
    assert (tmp_path / "model").is_dir()
    assert (tmp_path / "optimizer").is_dir()


@pytest.mark.parametrize("distplan", ["CAI_Gemini", "CAI_ZeRO2"])
def test_gpt_demo_style_flow(distplan: str) -> None:
    """train_gpt_demo.py's shape: a lazily built GPT-2 under Gemini (materialised at boost), ZeRO-2 eagerly."""
    figures = _torchrun(FLOWS / "gpt_demo_flow.py", distplan)
    assert figures["last"] < 0.6 * figures["first"], figures  # it learns the two batches
    assert figures["numel"] > 0
    assert figures["tflops"] > 0
