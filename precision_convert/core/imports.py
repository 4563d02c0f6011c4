"""Work that only a module's users need, done when that module is first imported, not at start.

:func:`when_imported` lets code that owns its process (the command, a batch worker) set up a
library (the Hub client's bounds, the heap torch builds) without importing it at start, so a
run that never uses the library never pays its import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then(module)`` once the module ``name`` (e.g. ``"torch"``) has been imported:
    now, when it already is; else right after its first import completes, in the importing
    thread. The module keeps its own loader."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return
    sys.meta_path.insert(0, _OnImport(name, then))


class _OnImport(MetaPathFinder):
    """Finds nothing itself: on the first import of its module it hands back the spec the
    other finders give, its loader wrapped to call ``then``; after that it answers nothing.

    It stays in ``sys.meta_path`` once spent: taking it out would shift the list under
    another thread's import iterating it, which could then skip a finder."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then: Callable[[ModuleType], None] | None = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != self.name or self.then is None:
            return None
        then, self.then = self.then, None  # spent before the search below meets it again
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, then)
        return spec


class _ThenLoader(Loader):
    """``loader``, calling ``then`` after it executes the module; the module's ``__loader__``
    and ``__spec__.loader`` name ``loader`` itself."""

    def __init__(self, loader: Loader, then: Callable[[ModuleType], None]) -> None:
        self.loader = loader
        self.then = then

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # The module's own loader from the start of its body: what it reads of itself
        # (resources, source) goes to the loader that found it.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.then(module)

    def __getattr__(self, name: str) -> Any:  # what else is asked of it before exec_module
        return getattr(self.loader, name)
