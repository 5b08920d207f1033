"""Run a callback on a module right after its first import, before any importer sees it."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]


class _Loader(importlib.abc.Loader):
    """The module's own loader, with the callbacks run after it executed the module."""

    def __init__(self, loader: Any, finder: _Finder) -> None:
        self._loader = loader
        self._finder = finder

    def __getattr__(self, name: str) -> Any:
        if name in ("_loader", "_finder"):  # not set yet: a copy made without __init__
            raise AttributeError(name)
        return getattr(self._loader, name)

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in self._finder.pending.pop(module.__name__, ()):
            callback(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of each pending module; the callbacks stay pending until it runs,
    so a `find_spec` that imports nothing loses none."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callback]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if _is_ours(finder) or find is None else find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None


def _is_ours(finder: Any) -> bool:
    """A finder of this module, whichever import of it made it (a reload makes another)."""
    return type(finder).__module__ == __name__ and type(finder).__qualname__ == "_Finder"


# The finder an earlier import of this module left on sys.meta_path, its callbacks pending.
_FINDER: _Finder = next(filter(_is_ours, sys.meta_path), None) or _Finder()


def on_first_import(name: str, callback: Callback) -> None:
    """`callback(module)` once module `name` is imported; at once if it already is."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    _FINDER.pending.setdefault(name, []).append(callback)


def is_pending(name: str) -> bool:
    return name in _FINDER.pending
