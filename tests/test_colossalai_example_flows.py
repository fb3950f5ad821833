"""ColossalAI-style example flows on cx, end to end on 2 CPU processes under torchrun: a Llama benchmark-style run
(gradient checkpointing, bf16, HybridAdam, cosine warm-up, clipping) under Gemini and LowLevelZero, which must learn
(loss falls), count parameters as before boost, and save a checkpoint that loads back to the same loss."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cx_mesh.testing import free_port

pytest.importorskip("transformers")

FLOW = Path(__file__).parent / "colossalai_flows" / "llama_benchmark_flow.py"


@pytest.mark.parametrize("plugin", ["gemini", "low_level_zero"])
def test_llama_benchmark_style_flow(plugin: str, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(FLOW), plugin, str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(text for text in result.stdout.splitlines() if text.startswith("{"))
    figures = json.loads(line)
    assert figures["last"] < 0.6 * figures["first"], figures  # it learns the batch
    assert abs(figures["reloaded"] - figures["trained"]) < 1e-2 * figures["trained"] + 1e-4, figures
    assert (tmp_path / "model").is_dir()
    assert (tmp_path / "optimizer").is_dir()
