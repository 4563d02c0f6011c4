"""Check the import layers of docs/architecture.md on the package as it is installed.

import-linter builds its graph by walking the root package's directory. precision-convert's
stages live in top-level folders (``convert/``, ``recipes/``, ``validate/``) that setuptools maps
into the ``precision_convert`` namespace, so no directory of the source tree holds them all and a
plain ``lint-imports`` would silently skip most modules. This script lays the tree out as a
wheel installs it, from pyproject's own mapping, and checks that copy:

1. import-linter's contracts from pyproject.toml (the layers, function-local imports included);
2. every module belongs to a layer (a package whose ``__init__`` imports nothing of ours may
   stay outside), so a new folder cannot slip past the contract;
3. no import cycle at all, within a layer too, and nothing imports the root package back.

Usage: ``python tools/check_imports.py [REPO]``; exit 0 when all hold, 1 with the report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = "precision_convert"


def install_layout(repo: Path, into: Path) -> Path:
    """Copy ``repo``'s packages into ``into`` the way a wheel lays them out; returns ``into``."""
    setuptools = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped: dict[str, str] = setuptools.get("package-dir", {})
    for package in setuptools["packages"]:
        # The longest mapped prefix decides where a package's files come from.
        prefix = max(
            (p for p in mapped if package == p or package.startswith(p + ".")),
            key=len,
            default=None,
        )
        source = (
            repo / mapped[prefix] / Path(*package[len(prefix) + 1 :].split("."))
            if prefix
            else repo / Path(*package.split("."))
        )
        target = into / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for file in source.glob("*.py"):
            shutil.copy2(file, target / file.name)
    return into


def layer_modules(repo: Path) -> list[str]:
    config = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["importlinter"]
    names = []
    for contract in config["contracts"]:
        for layer in contract.get("layers", []):
            names += [part.strip() for part in layer.replace(":", "|").split("|")]
    return names


def structural_problems(site: Path, layered: list[str]) -> list[str]:
    """Modules outside every layer, import cycles, and imports of the root package.

    Run in a process of its own (see :func:`check`): grimp finds the package through the
    import system, which in a process that already imported ``precision_convert`` answers
    with that copy, not the one under ``site``.
    """
    import grimp

    graph = grimp.build_graph(ROOT, cache_dir=None)
    problems = []
    for module in sorted(graph.modules):
        in_layer = any(module == m or module.startswith(m + ".") for m in layered)
        own_imports = graph.find_modules_directly_imported_by(module)
        if not in_layer and module != ROOT and own_imports:
            problems.append(f"{module} belongs to no layer (add it to pyproject's layers)")
    for importer in sorted(graph.find_modules_that_directly_import(ROOT)):
        problems.append(f"{importer} imports the root package {ROOT} (import the module itself)")
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in _cycles(graph)]
    return problems


def _cycles(graph: object) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.find_modules_directly_imported_by(node)):  # type: ignore[attr-defined]
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.append(item)
                if item == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):  # type: ignore[attr-defined]
        if module not in index:
            visit(module)
    return found


def check(repo: Path) -> tuple[bool, str]:
    """Lay out ``repo`` as installed and run every check; returns (passed, report)."""
    with tempfile.TemporaryDirectory(prefix="pc-layers-") as tmp:
        site = install_layout(repo, Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(site)}
        linted = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())",
                "--config",
                str(repo / "pyproject.toml"),
                "--no-cache",
                "--no-logo",
            ],
            cwd=site,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        structure = subprocess.run(
            [sys.executable, __file__, "--structure", str(repo)],
            cwd=site,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    report = linted.stdout + linted.stderr + structure.stdout + structure.stderr
    return linted.returncode == 0 and structure.returncode == 0, report


def main() -> int:
    if sys.argv[1:2] == ["--structure"]:  # the child process of check(), on PYTHONPATH's copy
        problems = structural_problems(Path.cwd(), layer_modules(Path(sys.argv[2])))
        print("".join(f"{p}\n" for p in problems), end="")
        return 1 if problems else 0
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    passed, report = check(repo)
    print(report.rstrip())
    print("import layers: " + ("kept" if passed else "BROKEN"))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
