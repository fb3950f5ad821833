"""Import every module of one cx package (`python tools/import_package.py plugins`), as `nox -s package_tests` does in
a venv holding only that package and what it declares: a module that needs an undeclared package fails here by
name. `__main__` modules are skipped (importing one runs the command)."""

from __future__ import annotations

import importlib
import pkgutil
import sys


def import_all(package: str) -> int:
    """Import `cx_<package>` and every module below it; returns how many were imported."""
    root = importlib.import_module(f"cx_{package}")
    count = 1
    for module in pkgutil.walk_packages(root.__path__, f"{root.__name__}."):
        if module.name.rpartition(".")[2] != "__main__":
            importlib.import_module(module.name)
            count += 1
    return count


if __name__ == "__main__":
    name = sys.argv[1]
    print(f"import check: {import_all(name)} modules of cx_{name} imported")
