"""The `layers` check itself: it passes on the repository and catches each kind of planted violation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_layers", ROOT / "tools" / "check_layers.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_layers"] = module
    spec.loader.exec_module(module)
    return module


checker = _load_checker()


def _package(root: Path, name: str, deps: list[str], source: str = "") -> None:
    folder = root / "packages" / name
    (folder / "src" / f"cx_{name}").mkdir(parents=True)
    listed = ", ".join(f'"{d}"' for d in ["torch>=2.4", *deps])
    (folder / "pyproject.toml").write_text(f'[project]\nname = "cx-{name}"\ndependencies = [{listed}]\n')
    (folder / "src" / f"cx_{name}" / "__init__.py").write_text(source)


def test_layers_repository_is_clean() -> None:
    assert checker.check(ROOT) == []


def test_layers_flags_undeclared_import(tmp_path: Path) -> None:
    _package(tmp_path, "mesh", [])
    _package(tmp_path, "chunk", [], "import cx_mesh\n")
    problems = checker.check(tmp_path)
    assert len(problems) == 1
    assert "imports cx_mesh but cx-chunk does not declare cx-mesh" in problems[0]


def test_layers_flags_cycles(tmp_path: Path) -> None:
    _package(tmp_path, "mesh", ["cx-zero"])
    _package(tmp_path, "zero", ["cx-chunk"])
    _package(tmp_path, "chunk", ["cx-mesh"])
    problems = checker.check(tmp_path)
    assert problems == ["dependency cycle: chunk -> mesh -> zero -> chunk"]


def test_layers_flags_private_imports_and_unknown_packages(tmp_path: Path) -> None:
    _package(tmp_path, "mesh", [])
    _package(tmp_path, "chunk", ["cx-mesh", "cx-nothing"], "from cx_mesh._launch import launch\n")
    problems = checker.check(tmp_path)
    assert any("declares cx packages that do not exist: ['nothing']" in p for p in problems)
    assert any("imports private module cx_mesh._launch of cx-mesh" in p for p in problems)


def _plugins_module(root: Path, path: str, source: str) -> None:
    file = root / "packages" / "plugins" / "src" / "cx_plugins" / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(source)


def test_layers_plugin_families_import_each_other_only_through_shared_layers(tmp_path: Path) -> None:
    _package(tmp_path, "plugins", [])
    _plugins_module(tmp_path, "_layout.py", "")
    _plugins_module(tmp_path, "checkpoint_io/_replicated.py", "from cx_plugins._layout import Axis\n")
    _plugins_module(tmp_path, "hybrid/_plugin.py", "from cx_plugins.checkpoint_io._replicated import IO\n")
    _plugins_module(tmp_path, "moe_hybrid/_plugin.py", "from cx_plugins.hybrid._plugin import HybridParallelPlugin\n")
    _plugins_module(tmp_path, "demo/_plugins.py", "from cx_plugins.gemini._plugin import GeminiPlugin\n")
    _plugins_module(tmp_path, "demo/_dry_run.py", "from cx_plugins.plan._memory import predict_memory\n")
    _plugins_module(tmp_path, "plan/_enumerate.py", "from cx_plugins.hybrid._options import PipelineStyle\n")
    assert checker.check(tmp_path) == []

    _plugins_module(tmp_path, "gemini/_plugin.py", "from cx_plugins.hybrid._model import HybridParallelModule\n")
    _plugins_module(tmp_path, "gemini/_tp.py", "from ..low_level_zero import _plugin\n")
    _plugins_module(tmp_path, "hybrid/_model.py", "from cx_plugins.moe_hybrid import MoeHybridParallelPlugin\n")
    _plugins_module(tmp_path, "lazy/_tp.py", "import cx_plugins.fsdp._wrap\n")
    _plugins_module(tmp_path, "_booster.py", "from cx_plugins import hybrid\n")
    _plugins_module(tmp_path, "ddp/_plugin.py", "from cx_plugins import Booster\n")
    _plugins_module(tmp_path, "fsdp/_wrap.py", "from cx_plugins.plan import plan\n")
    _plugins_module(tmp_path, "lr_scheduler/_curves.py", "from cx_plugins.demo._mfu import flops_per_token\n")
    problems = checker.check(tmp_path)
    expected = [
        "_booster.py:1: shared layer _booster imports plugin family hybrid (cx_plugins.hybrid)",
        "ddp/_plugin.py:1: imports the package face cx_plugins",
        "fsdp/_wrap.py:1: fsdp imports the application plan (cx_plugins.plan)",
        "gemini/_plugin.py:1: plugin family gemini imports family hybrid (cx_plugins.hybrid._model)",
        "gemini/_tp.py:1: plugin family gemini imports family low_level_zero (cx_plugins.low_level_zero)",
        "hybrid/_model.py:1: plugin family hybrid imports family moe_hybrid (cx_plugins.moe_hybrid)",
        "lazy/_tp.py:1: shared layer lazy imports plugin family fsdp (cx_plugins.fsdp._wrap)",
        "lr_scheduler/_curves.py:1: lr_scheduler imports the application demo (cx_plugins.demo._mfu)",
    ]
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems, strict=True):
        assert want in got


def test_layers_test_file_basenames_are_unique() -> None:
    """pytest's default import mode imports test files by basename, so two equal names would collide."""
    seen: dict[str, Path] = {}
    for path in sorted([*ROOT.glob("packages/*/tests/**/*.py"), *ROOT.glob("tests/**/*.py")]):
        if path.name == "__init__.py" or path.name == "conftest.py":
            continue
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path
