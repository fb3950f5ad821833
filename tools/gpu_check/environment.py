"""Step `environment`: what this machine offers: torch and its CUDA, the device, and which optional libraries import."""

from __future__ import annotations

import platform
from importlib import metadata

from gpu_check_step import run_step

OPTIONAL = ("pytest", "numpy", "safetensors", "transformers", "hypothesis", "torchao")


def _version(name: str) -> str | None:
    """The installed distribution's version (read from its metadata: importing transformers alone takes seconds)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def main() -> str:
    import torch

    facts = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        facts.append(f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name()}")
        facts.append(f"sm{major}{minor}")
    else:
        facts.append("no CUDA device")
    versions = {name: _version(name) for name in OPTIONAL}
    present = [f"{name} {version}" for name, version in versions.items() if version is not None]
    missing = [name for name, version in versions.items() if version is None]
    facts.append(f"installed: {', '.join(present) or 'none'}")
    facts.append(f"missing: {', '.join(missing) or 'none'}")
    return "; ".join(facts)


if __name__ == "__main__":
    run_step(main)
