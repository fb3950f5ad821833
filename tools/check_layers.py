"""The `layers` check: cx packages import only siblings they declare, the declared graph has no cycle,
and nobody imports another package's private modules (`cx_x._something`).

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
    return problems


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
