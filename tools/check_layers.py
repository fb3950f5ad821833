"""The `layers` check: cx packages import only siblings they declare, the declared graph has no cycle,
and nobody imports another package's private modules (`cx_x._something`). Inside cx-plugins, the plugin families
(`cx_plugins/<family>/`) import each other only through the shared layers (MoeHybrid may extend Hybrid), and the
shared layers (the top-level modules, `checkpoint_io/`, `lazy/`, `models/`, `lr_scheduler/`) import no family; only
the package face (`cx_plugins/__init__.py`) and the applications, the demo (`cx-train`) and the planner (`plan/`,
`cx-plan`), sit above them, and nothing below imports an application.

Declared edges come from each packages/<name>/pyproject.toml `dependencies` (`cx-<name>` entries). Imports come
from parsing every .py file under the package's src/ and tests/ with `ast`. Exit code 1 on any violation.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9_.\-]+)")


def declared_dependencies(package_dir: Path) -> set[str]:
    """Sibling packages (by folder name) that a package declares, runtime and test extras alike."""
    project = tomllib.loads((package_dir / "pyproject.toml").read_text())["project"]
    requirements = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        requirements += extra
    names = set()
    for requirement in requirements:
        match = _REQUIREMENT_NAME.match(requirement)
        if match and match.group(1).lower().startswith("cx-"):
            names.add(match.group(1).lower().removeprefix("cx-"))
    return names


def imported_cx_modules(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import of a `cx_*` module in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name.startswith("cx_")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("cx_"):
            found.append((node.lineno, node.module))
    return found


PLUGINS_PACKAGE = "cx_plugins"
PLUGIN_FAMILIES = frozenset({"ddp", "fsdp", "low_level_zero", "gemini", "hybrid", "moe_hybrid"})
PLUGIN_FAMILY_EDGES = frozenset({("moe_hybrid", "hybrid")})  # (importer, imported) allowed between families
PLUGINS_APPLICATIONS = frozenset({"demo", "plan"})  # may import every family and each other; nothing below imports them
PLUGINS_ABOVE_FAMILIES = frozenset({"__init__", *PLUGINS_APPLICATIONS})  # may import every family


def _module_name(source: Path, src: Path) -> str:
    parts = list(source.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(source: Path, module: str) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, dotted module, names taken from it) for every import in a file, relative ones resolved."""
    tree = ast.parse(source.read_text(), filename=str(source))
    package = module if source.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str, tuple[str, ...]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.append((node.lineno, base, tuple(alias.name for alias in node.names)))
    return found


def _plugins_part(module: str) -> str | None:
    """The part of cx_plugins a module belongs to: its first component below the package ("__init__" for the
    package face itself, top-level modules by their own name); None outside cx_plugins."""
    top, _, rest = module.partition(".")
    if top != PLUGINS_PACKAGE:
        return None
    return rest.split(".")[0] if rest else "__init__"


def check_plugin_families(root: Path) -> list[str]:
    """Dependency direction inside cx-plugins: a family imports no other family (but the allowed edges), a shared
    layer imports no family, and neither imports the package face (which imports every family) nor an application."""
    src = root / "packages" / "plugins" / "src"
    if not (src / PLUGINS_PACKAGE).is_dir():
        return []
    problems = []
    for source in sorted((src / PLUGINS_PACKAGE).rglob("*.py")):
        module = _module_name(source, src)
        importer = _plugins_part(module)
        if importer is None or importer in PLUGINS_ABOVE_FAMILIES:
            continue
        where = f"{source.relative_to(root)}"
        reported: set[tuple[int, str]] = set()
        imports = []
        for line, imported, names in _imported_modules(source, module):
            if imported != PLUGINS_PACKAGE:
                imports.append((line, imported))
                continue
            parts = [n for n in names if (src / imported / n).is_dir() or (src / imported / f"{n}.py").is_file()]
            imports += [(line, f"{imported}.{n}") for n in parts]
            if not names or len(parts) < len(names):  # `import cx_plugins` or a name the face exports
                imports.append((line, imported))
        for line, imported in imports:
            target = _plugins_part(imported)
            if target is None or target == importer or (line, target) in reported:
                continue
            if target == "__init__":
                problem = f"imports the package face {PLUGINS_PACKAGE}; import the module that defines the name"
            elif target in PLUGINS_APPLICATIONS:
                problem = f"{importer} imports the application {target} ({imported}), which sits above it"
            elif target not in PLUGIN_FAMILIES or (importer, target) in PLUGIN_FAMILY_EDGES:
                continue
            elif importer in PLUGIN_FAMILIES:
                problem = f"plugin family {importer} imports family {target} ({imported}): share through a shared layer"
            else:
                problem = f"shared layer {importer} imports plugin family {target} ({imported})"
            reported.add((line, target))
            problems.append(f"{where}:{line}: {problem}")
    return problems


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A dependency cycle as a list of package names, or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in visiting:
            return [*visiting[visiting.index(node) :], node]
        if node in done:
            return None
        visiting.append(node)
        for nxt in sorted(graph.get(node, ())):
            cycle = visit(nxt)
            if cycle:
                return cycle
        visiting.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def check(root: Path) -> list[str]:
    packages = {p.name: p for p in sorted((root / "packages").iterdir()) if (p / "pyproject.toml").is_file()}
    graph = {name: declared_dependencies(path) for name, path in packages.items()}
    problems = []
    for name, deps in graph.items():
        unknown = deps - set(packages)
        if unknown:
            problems.append(f"{name}: declares cx packages that do not exist: {sorted(unknown)}")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("dependency cycle: " + " -> ".join(cycle))
    for name, path in packages.items():
        for source in sorted(path.rglob("*.py")):
            for line, module in imported_cx_modules(source):
                top, *rest = module.split(".")
                target = top.removeprefix("cx_")
                where = f"{source.relative_to(root)}:{line}"
                if target != name and target not in graph[name]:
                    problems.append(f"{where}: imports {module} but cx-{name} does not declare cx-{target}")
                if target != name and any(part.startswith("_") for part in rest):
                    problems.append(f"{where}: imports private module {module} of cx-{target}")
    return problems + check_plugin_families(root)


def main() -> int:
    problems = check(ROOT)
    for problem in problems:
        print(problem)
    if problems:
        print(f"layers: {len(problems)} problem(s)")
        return 1
    print("layers: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
