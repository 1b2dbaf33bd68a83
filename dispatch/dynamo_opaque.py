"""Dynamo never compiles adaptive-eager's own code: every frame of ours, and all it calls, runs as written.

Note [Opaque to Dynamo]: while torch.compile runs a compiled function, Dynamo's frame hook
is installed, and any Python frame that starts in that time is offered to Dynamo to compile:
the parts between graphs (a graph break such as `.item()`), a frame Dynamo gave up on, and
the frames C++ calls back into, such as the engine's route, our PrivateUse1 kernels and
the host sync. Compiling those is wrong: it traces the engine's bookkeeping
with fake tensors, where it fails (`nbytes` of a symbolic size) or, worse, records side
effects as a graph. It happened whenever a compiled call fell back to running eagerly, for
instance when a structured-trace handler on the `torch.__trace` logger (pytest 9.2's logging
plugin attaches one to every non-propagating logger) made AOTAutograd `repr` our tensors.

Torch's own code is skipped by file (Dynamo's SKIP_DIRS), but registering directories there
needs `torch._dynamo` imported, which costs seconds at `import torch`. Instead each of our
code objects carries Dynamo's frame strategy (SKIP, SKIP), read by the C hook alone:
this frame is not compiled, nor is any frame it calls, whatever file that is in (a user's
custom kernel, a matcher we generate with `exec`). It costs nothing when Dynamo is not running.
"""
from __future__ import annotations

import os
import sys
import types

from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

_OPAQUE = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
_REALPATH: dict[str, str] = {}  # co_filename -> its real path (realpath costs syscalls)


def hide_packages(names: tuple[str, ...], extra_modules: tuple[str, ...] = ()) -> int:
    """Mark every code object of the loaded modules of these packages (and `extra_modules`);
    the number of code objects marked."""
    modules = [m for n, m in list(sys.modules.items())
               if n.split(".")[0] in names or n in extra_modules]
    # Every package's folder, subpackages included: adaptive_eager.device and .dispatch are
    # folders beside adaptive_eager/, not under it (pyproject.toml's package-dir).
    roots = sorted({os.path.join(os.path.realpath(p), "") for m in modules for p in getattr(m, "__path__", None) or ()})
    # An extra module without a file adds nothing (realpath("") would be the working directory).
    files = tuple(roots) + tuple(os.path.realpath(m.__file__) for m in modules
                                 if m.__name__ in extra_modules and getattr(m, "__file__", None))
    marked: set[int] = set()
    for module in modules:
        hide_module(module, files, marked)
    return len(marked)


def hide_module(module: types.ModuleType, files: tuple[str, ...], marked: set[int] | None = None) -> None:
    """Mark the code objects defined in `module` (functions, methods, properties, nested code)
    whose source file lies under one of `files` (imported names of others are left alone)."""
    marked = set() if marked is None else marked
    seen: set[int] = set()
    for value in list(vars(module).values()):
        _hide(value, files, marked, seen)


def _hide(obj, files, marked: set[int], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                _hide(f, files, marked, seen)
        return
    wrapped = getattr(obj, "__wrapped__", None)  # functools.wraps, lru_cache, torch.library ops
    if wrapped is not None and not isinstance(obj, type):
        _hide(wrapped, files, marked, seen)
    if isinstance(obj, types.FunctionType):
        _hide_code(obj.__code__, files, marked)
    elif isinstance(obj, type):
        for value in list(vars(obj).values()):
            _hide(value, files, marked, seen)


def _ours(filename: str, files: tuple[str, ...]) -> bool:
    real = _REALPATH.get(filename)
    if real is None:
        real = _REALPATH[filename] = os.path.realpath(filename)
    return real.startswith(files)


def _hide_code(code: types.CodeType, files, marked: set[int]) -> None:
    if id(code) in marked or not _ours(code.co_filename, files):
        return
    set_code_exec_strategy(code, _OPAQUE)
    marked.add(id(code))
    for const in code.co_consts:  # closures, lambdas, comprehensions, nested classes' bodies
        if isinstance(const, types.CodeType):
            _hide_code(const, files, marked)


def hide_late_module(name: str) -> None:
    """Mark a module of ours imported after `hide_packages` ran (at the end of its own body)."""
    module = sys.modules[name]
    hide_module(module, (os.path.realpath(module.__file__),))
