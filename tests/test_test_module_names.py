"""Test and helper module names are unique across the repository.

The full suite runs every package's tests in one pytest process, which imports test folders by module name, and the
pooled test ranks (cx_mesh.testing) import each test function's module by name too. Two `moe_test_helpers.py` in
different packages therefore pass in each package's own run and fail only together, in the full suite.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SHARED_BY_DESIGN = {"__init__.py", "conftest.py"}


def test_test_module_names_are_unique() -> None:
    places: dict[str, list[str]] = defaultdict(list)
    for path in [*ROOT.glob("packages/*/tests/**/*.py"), *ROOT.glob("tests/**/*.py")]:
        if path.name not in _SHARED_BY_DESIGN:
            places[path.name].append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in places.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a name (rename one): {clashes}"
