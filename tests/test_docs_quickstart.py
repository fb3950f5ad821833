"""docs/quickstart.md's own-training-loop snippet, extracted from the page and run as written under torchrun on one
process, so it cannot rot: it must train (the loss it prints below what token frequencies alone give) and write the
checkpoint it names."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

from cx_mesh.testing import free_port

QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
PATTERN_PERIOD = 97  # the snippet's stand-in data: tokens 0..96 repeating


def training_loop_snippet() -> str:
    """The first python block under '## Your own training loop'."""
    text = QUICKSTART.read_text()
    section = text[text.index("## Your own training loop") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the training-loop section has a python block"
    return match.group(1)


def test_quickstart_training_loop_runs(tmp_path: Path) -> None:
    snippet = training_loop_snippet()
    assert f"% {PATTERN_PERIOD}" in snippet, "the snippet's data changed: update PATTERN_PERIOD"
    script = tmp_path / "train.py"
    script.write_text(snippet)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), str(script),
    ]  # fmt: skip
    result = subprocess.run(
        command, cwd=tmp_path, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    loss = float(re.findall(r"last loss (\S+)", result.stdout)[-1])
    # a model that learned only how often each token occurs scores ln(97) on a uniform cycle of 97 tokens; the next
    # token is determined by the current one, so a model that trained at all scores below that
    assert loss < math.log(PATTERN_PERIOD), result.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "ckpt" / "model").iterdir()) == [
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    assert any(p.suffix == ".safetensors" for p in (tmp_path / "ckpt" / "optimizer").iterdir())
