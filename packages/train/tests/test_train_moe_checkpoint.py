"""`cx-train --model mixtral --plugin moe_hybrid --ep 2`: MoE checkpoints through the trainer. Saved and resumed runs
give the losses of one straight run (at ep 2, at ep 1 and under Gemini: the expert slices are gathered into the
Hugging Face layout on save and resharded on load), and the saved model folder loads with `from_pretrained`.
The plugin-level MoE checkpoint tests are cx-plugins' test_plugins_moe_checkpoint*.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cx_mesh.testing import distributed
from cx_train import parse_options
from cx_train._train import run

transformers = pytest.importorskip("transformers")
# fp32 tiny Mixtral, 4 steps: a resumed run differs from the straight one by the reduction order of a reloaded
# state alone (the plugin tests derive the same 1e-4 bound)
RTOL = 1e-4


DEMO = ["--batch-size", "2", "--seq-len", "16", "--lr", "1e-2", "--hidden-size", "32", "--log-every", "100"]
MOE_DEMO = ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "2"]


@distributed(world_size=2)
def test_train_moe_checkpoint_resumes_exactly(rank: int, world_size: int, tmp_path: Path) -> None:
    """`cx-train --plugin moe_hybrid --ep 2`: 2 steps saved + 2 resumed give the losses of 4 straight steps, resumed
    at ep 2, at ep 1 and under GeminiPlugin (the same two data-parallel ranks each time)."""
    checkpoint = str(tmp_path / "ckpt")
    straight = run(parse_options([*DEMO, *MOE_DEMO, "--steps", "4"]))
    first = run(parse_options([*DEMO, *MOE_DEMO, "--steps", "2", "--save", checkpoint]))
    rest = run(parse_options([*DEMO, *MOE_DEMO, "--steps", "4", "--resume", checkpoint]))
    ep1 = ["--model", "mixtral", "--plugin", "moe_hybrid", "--ep", "1"]
    rest_ep1 = run(parse_options([*DEMO, *ep1, "--steps", "4", "--resume", checkpoint]))
    gemini = ["--model", "mixtral", "--plugin", "gemini"]
    rest_gemini = run(parse_options([*DEMO, *gemini, "--steps", "4", "--resume", checkpoint]))
    for resumed in (rest, rest_ep1, rest_gemini):
        assert (len(first), len(resumed)) == (2, 2)
        torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(straight), rtol=RTOL, atol=RTOL / 10)


def test_train_moe_checkpoint_command_line(tmp_path: Path) -> None:
    """The command line itself: `--save` and then `--resume` with --ep 2 (refused before MoE checkpoints existed);
    the saved model folder loads with MixtralForCausalLM."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1"}
    checkpoint = tmp_path / "ckpt"

    def cx_train(*flags: str) -> str:
        command = [sys.executable, "-m", "cx_train", *DEMO, *MOE_DEMO, *flags]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
        return result.stdout

    assert f"saved step 2 to {checkpoint}" in cx_train("--steps", "2", "--save", str(checkpoint))
    assert f"resumed from {checkpoint} at step 2" in cx_train("--steps", "3", "--resume", str(checkpoint))
    _, info = transformers.MixtralForCausalLM.from_pretrained(
        str(checkpoint / "model"), local_files_only=True, output_loading_info=True
    )
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
