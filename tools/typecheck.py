"""Type-check the product with mypy, on the package laid out as it is installed.

mypy finds modules by their folders, and ``convert/``, ``recipes/`` and ``validate/`` are
installed under other names (``precision_convert.conversion``…; see check_imports.py), so the
source tree alone would not resolve their imports. This script lays the tree out as a wheel
would under ``build/typecheck/`` (a fixed place, so mypy's cache there serves the next run),
runs mypy with pyproject's ``[tool.mypy]`` and reports every error at its source path.

Usage: ``python tools/typecheck.py``; exit status is mypy's.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _install_layout() -> object:
    spec = importlib.util.spec_from_file_location("check_imports", REPO / "tools/check_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.install_layout


def main() -> int:
    site = REPO / "build/typecheck"
    shutil.rmtree(site / "precision_convert", ignore_errors=True)
    _install_layout()(REPO, site)  # type: ignore[operator]
    shutil.copy2(REPO / "precision_convert/py.typed", site / "precision_convert/py.typed")
    done = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml")),
            *("--cache-dir", str(site / ".mypy_cache"), "-p", "precision_convert"),
        ],
        cwd=site,
        capture_output=True,
        text=True,
        check=False,
    )
    # Installed paths back to the folders they come from, longest package first.
    mapped = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = sorted(mapped["package-dir"].items(), key=lambda item: -len(item[0]))
    report = done.stdout + done.stderr
    for package, folder in folders:
        installed = re.escape(package.replace(".", "/"))
        report = re.sub(rf"^{installed}/", f"{folder}/", report, flags=re.M)
    print(report.rstrip())
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
