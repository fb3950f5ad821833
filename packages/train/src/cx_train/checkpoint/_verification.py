"""`--resume` verifies the checkpoint before any process starts: every shard of its model and optimizer is read in
full against the checksums recorded when it was saved (`cx_checkpoint.verify_checkpoints`), so a damaged file is
named up front instead of loading silently. `--no-verify` skips it (e.g. for a very large checkpoint on slow storage).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["VERIFY_COST", "verification_problem"]

# measured on the default demo checkpoint (GPT, hidden 128, 2 layers: model 1.7 MB, optimizer 3.2 MB; gemini,
# low_level_zero and torch_ddp loading it on 1 process of a busy 2-core CPU, warm page cache, 5 runs each): verify
# 13-34 ms, the load 7-47 ms. It reads and checksums every byte once more, so it costs about as much as the load's
# own reading; docs/quickstart.md has the figures.
VERIFY_COST = "it reads every file once more: 13-34 ms against 7-47 ms for the load of the 4.9 MB default checkpoint"


def verification_problem(resume: Path) -> str | None:
    """Why the checkpoint in `resume` must not be loaded (None when every file matches its recorded checksum)."""
    from cx_checkpoint import ChecksumMismatchError, VerifyOutcome, verify_checkpoints  # torch: after the flags

    results = verify_checkpoints(resume)
    if not results:
        return f"--resume {resume}: no model or optimizer checkpoint found in it"
    for result in results:
        if result.outcome is VerifyOutcome.FAILED:
            # only damaged bytes under intact structure load without verification; a refused index, path, link or
            # pickle is refused by the load itself, so --no-verify would not help there
            loads_anyway = result.detail.startswith(f"{ChecksumMismatchError.__name__}:")
            hint = "--no-verify loads it anyway, at your own risk" if loads_anyway else "loading refuses it too"
            return f"--resume {resume}: the checkpoint is damaged: {result.detail} ({hint})"
        if result.outcome is VerifyOutcome.UNVERIFIABLE:
            return f"--resume {resume}: {result.detail}; pass --no-verify to load it without verification"
    return None
