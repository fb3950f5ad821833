"""The `layers` check: cx packages import only siblings they declare, every declared edge points down the layer
order (mesh at the bottom; checkpoint, chunk, moe, pipeline; zero, shardformer; plugins; plan; train on top), and
nobody imports another package's private modules (`cx_x._something`). Inside cx-plugins, the plugin families
(`cx_plugins/<family>/`) import each other only through the shared layers (MoeHybrid may extend Hybrid), and the
shared layers (the top-level modules and the other folders) import no family; only the package face
(`cx_plugins/__init__.py`) sits above them. No two files anywhere in packages/ import each other, directly or round
a longer loop (`import_cycles`).

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


# Each package's layer: a declared dependency points to a lower layer (the developers' guide's direction).
LAYERS = {
    "mesh": 0, "checkpoint": 1, "chunk": 1, "moe": 1, "pipeline": 1, "zero": 2, "shardformer": 2, "plugins": 3,
    "plan": 4, "train": 5,
}  # fmt: skip
PLUGINS_PACKAGE = "cx_plugins"
PLUGIN_FAMILIES = frozenset({"ddp", "fsdp", "low_level_zero", "gemini", "hybrid", "moe_hybrid"})
PLUGIN_FAMILY_EDGES = frozenset({("moe_hybrid", "hybrid")})  # (importer, imported) allowed between families
PLUGINS_ABOVE_FAMILIES = frozenset({"__init__"})  # the package face may import every family


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
    layer imports no family, and neither imports the package face (which imports every family)."""
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
    for name, deps in sorted(graph.items()):
        upward = sorted(d for d in deps if d in LAYERS and name in LAYERS and LAYERS[d] >= LAYERS[name])
        if upward:
            problems.append(f"{name}: declares {upward}, which do not sit below it (layer order: {_order()})")
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
    return problems + check_plugin_families(root) + import_cycles(root)


def _order() -> str:
    layers: dict[int, list[str]] = {}
    for name, layer in LAYERS.items():
        layers.setdefault(layer, []).append(name)
    return " < ".join("/".join(sorted(names)) for _, names in sorted(layers.items()))


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that runs: at module level or inside functions (a lazy import is still a dependency),
    but not under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every package's sources (`cx_x.y._z`) and tests (by file name, as pytest
    imports them)."""
    modules: dict[str, Path] = {}
    for package in sorted((root / "packages").iterdir()):
        if (package / "src").is_dir():
            for source in sorted((package / "src").rglob("*.py")):
                modules[_module_name(source, package / "src")] = source
        if (package / "tests").is_dir():
            for source in sorted((package / "tests").rglob("*.py")):
                if source.name not in ("__init__.py", "conftest.py"):
                    modules[source.stem] = source
    return modules


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules it imports (the most specific one an import names: a submodule when `from pkg import
    name` names one, else the package's __init__)."""
    graph: dict[str, set[str]] = {}
    for module, source in modules.items():
        is_package = source.name == "__init__.py"
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(source.read_text(), filename=str(source))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    targets.add(name)
        graph[module] = targets
    return graph


def _loop_through(start: str, graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """The shortest import loop from `start` back to it inside one strongly connected component."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if nxt not in previous:
                    previous[nxt] = node
                    following.append(nxt)
        frontier = following
    return [start]


def import_cycles(root: Path) -> list[str]:
    """One problem per group of files that import each other (a strongly connected component of the file-level
    import graph of packages/), naming one loop through it."""
    modules = _modules(root)
    graph = _import_graph(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):  # Tarjan's algorithm, iteratively (import chains can be deep)
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    problems = []
    for component in components:
        loop = _loop_through(min(component), graph, component)
        files = " -> ".join(str(modules[m].relative_to(root)) for m in loop)
        problems.append(f"import cycle between {len(component)} files: {files}")
    return sorted(problems)


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
