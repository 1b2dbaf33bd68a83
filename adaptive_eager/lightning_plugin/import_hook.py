"""Running a function right after a module is first imported (Python has no such hook).

Lightning's accelerator registry is a module-level object filled when `lightning.pytorch` is
imported, and its Trainer resolves `accelerator="neuron"` against it. `import torch` loads this
package (torch's backend autoload) usually before the user imports Lightning, so registering
neuron has to wait for that import. A finder placed first on `sys.meta_path` answers only for
the watched names: it asks the other finders for the module's spec and wraps its loader so
that, once the module has run, the callback gets it.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]


class _NotifyingLoader(importlib.abc.Loader):
    """The module's own loader, then the callback. Every other attribute (resource readers,
    `get_source`, ...) is the wrapped loader's."""

    def __init__(self, loader, callback: Callback):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _notify(self._callback, module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


def _notify(callback: Callback, module: ModuleType) -> None:
    # A plugin that fails must not break the user's import of the library it extends.
    try:
        callback(module)
    except Exception as error:  # noqa: BLE001: said, with what it costs
        warnings.warn(f"adaptive-eager could not extend {module.__name__} ({type(error).__name__}: {error}); "
                      f"{module.__name__} works as without adaptive-eager.", RuntimeWarning, stacklevel=2)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self):
        self._callbacks: dict[str, list[Callback]] = {}
        self._finding = threading.local()

    def watch(self, name: str, callback: Callback) -> None:
        self._callbacks.setdefault(name, []).append(callback)

    def find_spec(self, name, path=None, target=None):
        callbacks = self._callbacks.pop(name, None)
        if not callbacks:
            return None
        busy = getattr(self._finding, "names", set())
        if name in busy:  # our own question to the other finders below
            self._callbacks[name] = callbacks
            return None
        self._finding.names = busy | {name}
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self._finding.names = busy
        if spec is None or spec.loader is None:
            self._callbacks[name] = callbacks  # not installed: watch for a later attempt
            return None

        def run_all(module: ModuleType) -> None:
            for callback in callbacks:
                callback(module)

        spec.loader = _NotifyingLoader(spec.loader, run_all)
        return spec


_FINDER = _AfterImportFinder()
_lock = threading.Lock()


def when_imported(name: str, callback: Callback) -> None:
    """Call callback(module) once `name` has been imported: now if it already is, else right
    after its first import."""
    with _lock:
        module = sys.modules.get(name)
        if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
            _notify(callback, module)
            return
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)
        _FINDER.watch(name, callback)
