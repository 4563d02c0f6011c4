"""The import layers of docs/architecture.md hold, and the check would see them broken.

tools/check_imports.py lints the package laid out as installed; these tests prove that modules
mapped in from the top-level folders are in its graph by adding a back-edge there (inside a
function, where a lazy import would hide from a top-level-only check) and watching it fail.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[1]

pytest.importorskip("importlinter", reason="import-linter is not installed (.[test] extra)")


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_imports", REPO / "tools/check_imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_repo(into: Path) -> Path:
    for name in ("pyproject.toml", "precision_convert", "convert", "recipes", "validate"):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, into / name)
    return into


def _append(path: Path, code: str) -> None:
    path.write_text(path.read_text() + "\n\n" + code + "\n")


def test_layers_are_kept() -> None:
    passed, report = _checker().check(REPO)
    assert passed, report
    assert "KEPT" in report


def test_back_edge_from_a_mapped_folder_breaks_the_check(tmp_path: Path) -> None:
    repo = _copy_repo(tmp_path)
    _append(
        repo / "convert/io/tensors.py",
        "def _sneaky() -> None:\n    from precision_convert.cli import main  # noqa: F401",
    )
    passed, report = _checker().check(repo)
    assert not passed
    assert "precision_convert.conversion.io.tensors -> precision_convert.cli.main" in report


def test_cycle_inside_one_layer_breaks_the_check(tmp_path: Path) -> None:
    repo = _copy_repo(tmp_path)
    # The loader imports the builders; a builder importing the loader back closes a cycle
    # inside the runtime layer, which a layers contract alone would not see.
    _append(
        repo / "convert/runtime/builders.py",
        "def _sneaky() -> None:\n"
        "    from precision_convert.conversion.runtime import loader  # noqa: F401",
    )
    passed, report = _checker().check(repo)
    assert not passed
    assert "import cycle" in report and "precision_convert.conversion.runtime.loader" in report


#: Most lines a product module may have: past it, a module holds more than one responsibility
#: and is split by them (docs/architecture.md lists each module and what it is for).
MAX_MODULE_LINES = 600


def test_no_product_module_is_over_the_size_limit() -> None:
    sizes = {
        path.relative_to(REPO).as_posix(): len(path.read_text().splitlines())
        for folder in ("precision_convert", "convert", "validate", "recipes")
        for path in (REPO / folder).rglob("*.py")
    }
    assert len(sizes) > 50  # the walk found the product, not an empty folder
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_the_exceptions_stay_importable_where_callers_catch_them() -> None:
    import precision_convert.core.errors as core
    import precision_convert.errors as documented

    public = {
        name
        for name, value in vars(core).items()
        if isinstance(value, type) and issubclass(value, Exception)
    }
    assert public and public <= set(documented.__all__)
    assert all(getattr(documented, name) is getattr(core, name) for name in public)
