"""The reliability suite: its bounded part runs with the rest of the tests; its full mode
(the tests marked ``slow``) only when asked for, with ``pytest -m slow tests/reliability``
(or ``PC_RELIABILITY_FULL=1``), or through ``bench/reliability.py``, which prints the counts.

The helpers in ``tests/`` are imported as top-level modules, as the tests there do; the parent
conftest already put ``tests/`` on ``sys.path`` when pytest starts from the repository, and
this makes sure of it when the folder is run alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

#: Set to 1 to run the full mode without ``-m slow``.
FULL_VARIABLE = "PC_RELIABILITY_FULL"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip this folder's ``slow`` tests unless the full mode was asked for."""
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get(FULL_VARIABLE):
        return
    skip = pytest.mark.skip(
        reason=f"full mode: pytest -m slow tests/reliability ({FULL_VARIABLE}=1)"
    )
    for item in items:
        if "slow" in item.keywords and HERE in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The trial models and reference outputs (``_harness.Sources``), built on first use."""
    import _harness

    return _harness.Sources(tmp_path_factory.mktemp("reliability-sources"))
