"""Step `train_mfu`: a short cx-train run (`python -m cx_train`, one process, the Gemini plugin, bf16) and its model
FLOPs utilisation. On CUDA a ~100M-parameter GPT trains 30 steps and the last progress window's MFU (steps 21-30,
past the first steps' warm-up) is reported; cx-train prints MFU on CUDA devices in its peak table (H100, H200,
A100), so a CUDA run without one fails. Without CUDA a tiny model trains a few steps (cx-train prints no MFU on a
CPU). Either way the run must exit 0 and its loss fall.

The numbers come from cx-train's progress lines (`step 30/30 loss 2.345 ... mfu 41.2% ...`), the last of which
goes into the report. Arguments after the script's name replace the run's flags (e.g. `--steps 60`).
"""

from __future__ import annotations

import re
import subprocess
import sys

import torch

from gpu_check_step import run_step

CUDA_FLAGS = [
    "--steps", "30", "--log-every", "10", "--hidden-size", "1024", "--num-layers", "8", "--seq-len", "1024",
    "--batch-size", "16",
]  # fmt: skip
CPU_FLAGS = ["--steps", "6", "--log-every", "2"]
COMMON_FLAGS = ["--nproc", "1", "--plugin", "gemini", "--precision", "bf16"]


PROGRESS = re.compile(r"step (?P<step>\d+)/\d+ loss (?P<loss>[\d.]+) ")
MFU = re.compile(r" mfu (?P<mfu>[\d.]+)% ")


def main() -> str:
    cuda = torch.cuda.is_available()
    flags = sys.argv[1:] or (CUDA_FLAGS if cuda else CPU_FLAGS)
    command = [sys.executable, "-m", "cx_train", *COMMON_FLAGS, *flags]
    print("$", " ".join(command), flush=True)
    run = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    print(run.stdout, flush=True)  # into this step's log (stderr goes there directly)
    if run.returncode:
        raise RuntimeError(f"cx-train exited with status {run.returncode}")
    lines = [line for line in run.stdout.splitlines() if PROGRESS.search(line)]
    if len(lines) < 2:
        raise AssertionError(f"cx-train printed {len(lines)} progress lines; the check needs two or more")
    first, last = (PROGRESS.search(line) for line in (lines[0], lines[-1]))
    assert first is not None
    assert last is not None
    if not float(first["loss"]) > float(last["loss"]):
        raise AssertionError(f"the loss did not fall: {first['loss']} at step {first['step']}, then {last['loss']}")
    mfu = MFU.search(lines[-1])
    if cuda and mfu is None:
        raise AssertionError(f"cx-train printed no MFU on {torch.cuda.get_device_name()} (not in its peak table?)")
    where = torch.cuda.get_device_name() if cuda else "cpu (cx-train prints no MFU there)"
    mfu_text = f"MFU {mfu['mfu']}%, " if mfu else ""
    return f"{mfu_text}{where}, cx-train {' '.join(COMMON_FLAGS + flags)}; last progress line: {lines[-1].strip()}"


if __name__ == "__main__":
    run_step(main)
