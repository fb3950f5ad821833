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
    assert problems[0] == "dependency cycle: chunk -> mesh -> zero -> chunk"
    assert problems[1].startswith("mesh: declares ['zero'], which do not sit below it")


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
    assert checker.check(tmp_path) == []

    _plugins_module(tmp_path, "gemini/_plugin.py", "from cx_plugins.hybrid._model import HybridParallelModule\n")
    _plugins_module(tmp_path, "gemini/_tp.py", "from ..low_level_zero import _plugin\n")
    _plugins_module(tmp_path, "hybrid/_model.py", "from cx_plugins.moe_hybrid import MoeHybridParallelPlugin\n")
    _plugins_module(tmp_path, "lazy/_tp.py", "import cx_plugins.fsdp._wrap\n")
    _plugins_module(tmp_path, "_booster.py", "from cx_plugins import hybrid\n")
    _plugins_module(tmp_path, "ddp/_plugin.py", "from cx_plugins import Booster\n")
    problems = checker.check(tmp_path)
    expected = [
        "_booster.py:1: shared layer _booster imports plugin family hybrid (cx_plugins.hybrid)",
        "ddp/_plugin.py:1: imports the package face cx_plugins",
        "gemini/_plugin.py:1: plugin family gemini imports family hybrid (cx_plugins.hybrid._model)",
        "gemini/_tp.py:1: plugin family gemini imports family low_level_zero (cx_plugins.low_level_zero)",
        "hybrid/_model.py:1: plugin family hybrid imports family moe_hybrid (cx_plugins.moe_hybrid)",
        "lazy/_tp.py:1: shared layer lazy imports plugin family fsdp (cx_plugins.fsdp._wrap)",
    ]
    problems = [p for p in problems if "import cycle" not in p]  # _booster <-> the face: a cycle test's matter
    assert len(problems) == len(expected), problems
    for want, got in zip(expected, problems, strict=True):
        assert want in got


def test_layers_flags_upward_imports_of_the_trainer_and_planner(tmp_path: Path) -> None:
    """cx-plugins sits below cx-plan and cx-train: importing them fails as undeclared, and declaring them fails as
    an edge that points up the layer order; cx-plan never reaches into cx-train's private modules."""
    _package(tmp_path, "plugins", [], "import cx_train\n")
    _package(tmp_path, "plan", ["cx-plugins"], "from cx_train.models._spec import build_model\n")
    _package(tmp_path, "train", ["cx-plan", "cx-plugins"])
    problems = checker.check(tmp_path)
    assert any("imports cx_train but cx-plugins does not declare cx-train" in p for p in problems), problems
    assert any("imports private module cx_train.models._spec of cx-train" in p for p in problems), problems
    _package(tmp_path / "declared", "plugins", ["cx-train"], "import cx_train\n")
    _package(tmp_path / "declared", "train", [])
    problems = checker.check(tmp_path / "declared")
    assert problems == ["plugins: declares ['train'], which do not sit below it (layer order: mesh < "
                        "checkpoint/chunk/moe/pipeline < shardformer/zero < plugins < plan < train)"]  # fmt: skip


def test_layers_flags_import_cycles_between_files(tmp_path: Path) -> None:
    """Two files that import each other, lazily inside a function too, fail; a TYPE_CHECKING import does not run
    and does not count."""
    _package(tmp_path, "mesh", [])
    source = tmp_path / "packages" / "mesh" / "src" / "cx_mesh"
    (source / "_a.py").write_text("from cx_mesh._b import B\n")
    (source / "_b.py").write_text("def f() -> None:\n    from cx_mesh import _c\n")
    (source / "_c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cx_mesh._a import A\n")
    assert checker.check(tmp_path) == []
    (source / "_c.py").write_text("from . import _a\n")
    problems = checker.check(tmp_path)
    assert problems == [
        "import cycle between 3 files: packages/mesh/src/cx_mesh/_a.py -> packages/mesh/src/cx_mesh/_b.py -> "
        "packages/mesh/src/cx_mesh/_c.py -> packages/mesh/src/cx_mesh/_a.py"
    ]


def test_layers_test_file_basenames_are_unique() -> None:
    """pytest's default import mode imports test files by basename, so two equal names would collide."""
    seen: dict[str, Path] = {}
    for path in sorted([*ROOT.glob("packages/*/tests/**/*.py"), *ROOT.glob("tests/**/*.py")]):
        if path.name == "__init__.py" or path.name == "conftest.py":
            continue
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path
