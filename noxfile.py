"""Development sessions for the cx monorepo. Packages are discovered from packages/*: adding one is adding a folder.

Every venv installs with constraints.txt, which pins torch to the CPU wheel on the dev machines (never a CUDA build).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file())
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
TEST_TOOLS = ("pytest>=8", "hypothesis>=6")
# What the shared venvs hold (`_shared_base`): torch, the test tools, and hatchling + editables so that editable
# installs build without an isolated build env; the second adds transformers for the packages that test with it.
SHARED = ("torch", "hatchling>=1.18", "editables", *TEST_TOOLS)
SHARED_HF = (*SHARED, "transformers>=5")
# Optional integrations exercised by the full suite (their tests skip where these are absent): transformers models,
# LoRA, cx-train's Parquet / save_to_disk data, TensorBoard events and metric plots, torchao's float8 training
# (TorchFSDPPlugin's use_fp8 and fp8 all-gather).
INTEGRATION_TOOLS = (
    "transformers>=4.40", "peft>=0.13", "pyarrow>=14", "datasets>=2.16", "tensorboard>=2.14", "matplotlib>=3.7",
    "torchao>=0.18",
)  # fmt: skip
# CX_JIT_FUSED_BACKEND: enable_jit_fused's kernels traced by aot_eager, not compiled by inductor (tens of seconds a
# process on a 2-core machine); cx-shardformer's fused-kernel test builds one with inductor itself
TEST_ENV = {
    "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1",
    "CX_JIT_FUSED_BACKEND": "aot_eager",
}  # fmt: skip

nox.options.sessions = ["tests", "typecheck", "lint", "layers"]
nox.options.reuse_existing_virtualenvs = True


def _extras(package: str) -> list[str]:
    """Optional test extras a package declares (e.g. transformers for integration tests), installed when present."""
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    extras = meta["project"].get("optional-dependencies", {})
    return [name for name in ("test",) if name in extras]


def _siblings(package: str) -> list[str]:
    """The cx packages `package` declares as runtime dependencies (by folder name)."""
    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    names = (re.match(r"\s*([A-Za-z0-9_.\-]+)", r) for r in meta["project"].get("dependencies", []))
    return [m.group(1).lower().removeprefix("cx-") for m in names if m and m.group(1).lower().startswith("cx-")]


def _with_siblings(package: str) -> list[str]:
    """`package` and every cx package it depends on, transitively, bottom first."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name not in ordered:
            for sibling in _siblings(name):
                visit(sibling)
            ordered.append(name)

    visit(package)
    return ordered


def _editable(package: str) -> list[str]:
    """Editable installs of `package` (with its test extra) and of the cx packages it declares: they are not on
    PyPI, so pip must be handed their folders."""
    args: list[str] = []
    for name in _with_siblings(package):
        extras = _extras(name) if name == package else []
        suffix = f"[{','.join(extras)}]" if extras else ""
        args += ["-e", f"packages/{name}{suffix}"]
    return args


def _shared_base(session: nox.Session, requirements: tuple[str, ...]) -> None:
    """Make `requirements` (third-party only: torch, test tools, transformers) visible in this session's venv from one
    shared venv, installed once per requirement set, instead of unpacking torch (~0.9 GB) into every venv: a `.pth`
    file puts the shared site-packages on this venv's path, after its own. What a session installs itself (the cx
    packages under test) stays in its own venv, so a package's venv still sees only what it declares plus these.
    Saves about 30 s per venv on a 2-core machine (`package_tests` makes ten)."""
    key = hashlib.sha256("\n".join((*requirements, (ROOT / "constraints.txt").read_text(), sys.version)).encode())
    base = ROOT / ".nox" / f"_shared-{key.hexdigest()[:12]}"
    python = base / "bin" / "python"
    if not (base / "complete").is_file():
        session.log(f"shared venv {base.name}: {' '.join(requirements)}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(base)], check=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *CONSTRAINTS]
        subprocess.run([*pip, *requirements], check=True)
        (base / "complete").write_text("\n".join(requirements) + "\n")
    site = _purelib(python)
    # the session's own python run directly (not session.run, which `--install-only` skips)
    own = _purelib(Path(session.bin) / "python")
    (Path(own) / "_cx_shared_base.pth").write_text(site + "\n")


def _purelib(python: Path) -> str:
    """The site-packages folder of the venv whose interpreter is `python`."""
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip()


def _install_all(session: nox.Session) -> None:
    """Every cx package (editable, with its test extra) over the shared venv holding torch and transformers."""
    _shared_base(session, SHARED_HF)
    args: list[str] = ["--no-build-isolation"]
    for package in PACKAGES:
        extras = _extras(package)
        args += ["-e", f"packages/{package}[{','.join(extras)}]" if extras else f"packages/{package}"]
    session.install(*CONSTRAINTS, *TEST_TOOLS, *args)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: `cx-train` with its defaults (a reference GPT on embedded text, 2 local processes), saving a
    checkpoint to ./cx-demo-checkpoint.

    Flags after `--` go to cx-train, e.g. `nox -s demo -- --steps 50 --nproc 4`.
    """
    session.install(*CONSTRAINTS, *_editable("train"))
    flags = session.posargs or ["--save", "cx-demo-checkpoint"]  # the default run leaves a checkpoint to look at
    session.run("cx-train", *flags, env={"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})


@nox.session
def tests(session: nox.Session) -> None:
    """Every package's tests and the integration tests in tests/, in one venv holding the whole stack."""
    _install_all(session)
    session.install(*CONSTRAINTS, *INTEGRATION_TOOLS)
    paths = [f"packages/{p}/tests" for p in PACKAGES if (ROOT / "packages" / p / "tests").is_dir()]
    if (ROOT / "tests").is_dir() and any((ROOT / "tests").glob("test_*.py")):
        paths.append("tests")
    if any(_is_test_path(argument) for argument in session.posargs):
        paths = []  # `nox -s tests -- path/to/test_file.py`: the path narrows the run
    session.run("python", "-m", "pytest", "--durations=20", *paths, *session.posargs, env=TEST_ENV)
    if os.environ.get("CX_NUMERICS") == "1":  # the numerics session's runs, in this venv (CI)
        _run_numerics(session, [])


def _is_test_path(argument: str) -> bool:
    """A pytest argument naming a file or folder (with or without a `::test` node id), not an option."""
    return not argument.startswith("-") and (ROOT / argument.split("::")[0]).exists()


@nox.session
@nox.parametrize("package", PACKAGES)
def package_tests(session: nox.Session, package: str) -> None:
    """One package alone, with only what it declares: every module of it imports and its tests collect (each test
    module imported), so a dependency it uses without declaring fails here by name. The tests themselves run in
    `tests` (the whole stack, once); `-- --run` runs them here too, e.g. before releasing one package alone."""
    test_extra = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())["project"]
    hf = any(r.startswith("transformers") for r in test_extra.get("optional-dependencies", {}).get("test", []))
    _shared_base(session, SHARED_HF if hf else SHARED)
    session.install("--no-build-isolation", *CONSTRAINTS, *TEST_TOOLS, *_editable(package))
    session.run("python", str(ROOT / "tools" / "import_package.py"), package, env=TEST_ENV)
    run = "--run" in session.posargs
    arguments = [a for a in session.posargs if a != "--run"]
    collect = [] if run else ["--collect-only", "-q"]
    # `python -m pytest`: pytest's script lives in the shared venv's bin/, not this one's
    session.run("python", "-m", "pytest", f"packages/{package}/tests", *collect, *arguments, env=TEST_ENV)


# The tests whose results depend on how ATen's CPU kernels round: a parallel or sharded run compared against one
# process after optimizer steps. `numerics` runs them under other kernels than the machine's best.
NUMERICS_TESTS = (
    *(
        f"packages/plugins/tests/test_plugins_{name}.py"
        for name in (
            "hybrid", "hybrid_gpt2", "hybrid_sp", "hybrid_precision", "hybrid_resume", "hybrid_checkpoint",
            "moe_hybrid", "moe_hybrid_pp", "moe_hybrid_qwen3", "moe_hybrid_sp", "moe_checkpoint", "gemini_tp",
            "gpt_policy", "ddp", "ddp_checkpoint", "fsdp", "zero", "gemini", "transformers", "lora", "clipping",
            "lazy_shards", "hybrid_zbv_tp", "hybrid_tied_accumulation", "hybrid_replica_agreement",
            "moe_ep_zero_fp16", "engine_optimizer",
        )
    ),
    *(
        f"packages/shardformer/tests/test_shardformer_{name}.py"
        for name in ("policies", "sequence", "moe", "ring", "generic_tied")
    ),
    *(
        f"packages/zero/tests/test_zero_{name}.py"
        for name in (
            "low_level_fp32", "low_level_mixed", "low_level_groups", "low_level_accumulation", "low_level_state",
            "gemini_fp32", "gemini_mixed", "gemini_transformers", "gemini_state", "adam",
        )
    ),
    "packages/pipeline/tests/test_pipeline_transformers.py",
    "packages/pipeline/tests/test_pipeline_tied_accumulation.py",
    "packages/pipeline/tests/test_pipeline_metadata_check.py",
    "tests/test_pipeline_with_zero.py",
    "tests/test_moe_with_zero.py",
    "packages/mesh/tests/test_fp8_numerics.py",  # fp8 bounds derived from the formats, whatever the kernel
    "packages/train/tests/test_train_checkpoint_compat.py",  # losses logged on one CPU, resumed on this one's kernels
)  # fmt: skip
# ATen's CPU kernel sets (ATEN_CPU_CAPABILITY), each with the /proc/cpuinfo flag it needs.
KERNELS = {"default": None, "avx2": "avx2"}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


@nox.session
def numerics(session: nox.Session) -> None:
    """The numerics-heavy tests (NUMERICS_TESTS) under the other ATen CPU kernel sets: a tolerance that holds only for
    one CPU's rounding fails here on any machine. One venv; each kernel set this CPU can run, except the one ATen
    already picks here (the `tests` session ran under it), e.g. only `default` on an AVX2 machine. `CX_KERNELS=avx2`
    (comma-separated) names the sets instead. `CX_NUMERICS=1 nox -s tests` runs the same after the suite, in its
    venv (CI does: one venv fewer to build)."""
    _install_all(session)
    session.install(*CONSTRAINTS, *INTEGRATION_TOOLS)
    _run_numerics(session, session.posargs)


def _run_numerics(session: nox.Session, arguments: list[str]) -> None:
    native = session.run(
        "python", "-c", "import torch; print(torch.backends.cpu.get_cpu_capability().lower())", silent=True
    )
    native = str(native or "").strip().splitlines()[-1] if native else ""
    chosen = os.environ.get("CX_KERNELS")
    kernels = chosen.split(",") if chosen else [k for k in KERNELS if k != native]
    flags = _cpu_flags()
    for kernel in kernels:
        if kernel not in KERNELS:
            session.error(f"CX_KERNELS: unknown kernel set {kernel!r}; one of {', '.join(KERNELS)}")
        needed = KERNELS[kernel]
        if needed is not None and needed not in flags:
            session.log(f"skipped {kernel}: this CPU has no {needed}, so ATen cannot run those kernels here")
            continue
        session.log(f"numerics under ATen's {kernel} kernels (this CPU's own: {native or 'unknown'})")
        session.run(
            "python", "-m", "pytest", *NUMERICS_TESTS, *arguments, env={**TEST_ENV, "ATEN_CPU_CAPABILITY": kernel}
        )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict (configured in the root pyproject.toml) on every package's sources and tests, the integration
    tests, the tools and the benchmarks."""
    _install_all(session)
    session.install(*CONSTRAINTS, "mypy>=1.10")
    for package in PACKAGES:
        session.run("mypy", f"packages/{package}/src", f"packages/{package}/tests")
    session.run("mypy", "tests", "tools", "benchmarks")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(venv_backend="none")
def layers(session: nox.Session) -> None:
    """The package dependency graph: declared edges only, no cycles, no reaching into private modules; inside
    cx-plugins, plugin families import each other only through the shared layers."""
    session.run("python", str(ROOT / "tools" / "check_layers.py"), external=True)


@nox.session
def gpu(session: nox.Session) -> None:
    """The CUDA/NCCL subset (tests marked `gpu`); they skip on machines without CUDA.

    Installs torch without the CPU pin so a GPU machine keeps (or gets) its CUDA build. On a machine that has its CUDA
    torch but no package index, `tools/gpu_check.sh` runs these tests and more with the torch installed there.
    """
    args: list[str] = []
    for package in PACKAGES:
        args += ["-e", f"packages/{package}"]
    session.install(*TEST_TOOLS, *args)
    env = dict(TEST_ENV)
    env.pop("GLOO_SOCKET_IFNAME")
    session.run("pytest", "-m", "gpu", *[f"packages/{p}/tests" for p in PACKAGES], *session.posargs, env=env)


DIST = ROOT / "dist"


@nox.session
def build(session: nox.Session) -> None:
    """The ten wheels, one per package, written to dist/ (old cx wheels there are removed first): a user installs
    the whole stack from them with `pip install --find-links dist 'cx-train[hf]'` (README, "Install")."""
    session.install("hatchling>=1.18")
    DIST.mkdir(exist_ok=True)
    for old in DIST.glob("cx_*.whl"):
        old.unlink()
    folders = [str(ROOT / "packages" / p) for p in PACKAGES]
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(DIST), *folders)


@nox.session
def install_check(session: nox.Session) -> None:
    """The README's install, tested: `pip install --find-links dist 'cx-train[hf]'` from the wheels `nox -s build`
    wrote, into this session's venv, then `cx-train --help`, `cx-plan --help` and a 2-process torchrun job
    (tools/install_check.py) that imports every package from site-packages and all-reduces over gloo. Run as
    `nox -s build install_check`."""
    built = {w.name.split("-", 1)[0] for w in DIST.glob("cx_*.whl")}
    missing = sorted(f"cx_{p}" for p in PACKAGES if f"cx_{p}" not in built)
    if missing:
        session.error(f"no wheel in {DIST} for {', '.join(missing)}: run `nox -s build` first")
    # A reused venv already holds cx 0.1.0, which pip would keep: remove it so the wheels just built are installed.
    session.run_install("python", "-m", "pip", "uninstall", "--yes", *(f"cx-{p}" for p in PACKAGES), silent=True)
    session.install(*CONSTRAINTS, "--find-links", str(DIST), "cx-train[hf]")
    session.chdir(session.create_tmp())  # outside the checkout, so nothing in it can be imported by accident
    session.run("cx-train", "--help", silent=True)
    session.run("cx-plan", "--help", silent=True)
    script = str(ROOT / "tools" / "install_check.py")
    session.run("torchrun", "--standalone", "--nproc_per_node", "2", script, env=TEST_ENV)


if os.environ.get("CI"):
    nox.options.reuse_existing_virtualenvs = False
