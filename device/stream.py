"""The device's stream: fused launches run on a worker thread while the host issues on.

A real accelerator runs a launch while the host goes on issuing the next ones; only a read
of a result (or an explicit synchronize) makes the host wait. The emulated device does the
same with `_stream.cpp`: a C++ worker thread that runs the boxed ATen calls of a launch
in issue order and never takes the GIL, so the host's Python and the launch's kernels use
two cores. (A Python thread cannot: measured in bench/feasibility/device_thread_overlap.py,
its GIL hand-offs made overlap slower than running one after the other.)

The extension is compiled once per machine with torch.utils.cpp_extension (g++ and ninja,
~40 s) into NEURON_STREAM_BUILD_DIR (default: torch's extension cache). Until it is built,
or where it cannot be (no compiler), or with NEURON_ASYNC_LAUNCH=0, launches run on the
issuing thread, with the same results. `stream_status()` says which it is.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stream.cpp")
with open(_SOURCE, "rb") as _f:
    # Named by its source: a build of another version is never loaded (nor rebuilt in the way).
    _NAME = "adaptive_eager_stream_" + hashlib.sha1(_f.read()).hexdigest()[:10]

_lock = threading.Lock()
_module = None
_status = "not loaded yet: launches run on the issuing thread"
_failed = False  # a build failed: not tried again in this process
_builder: threading.Thread | None = None


def async_launch_setting() -> str:
    """NEURON_ASYNC_LAUNCH: '1' (build the stream if needed, wait for it), '0' (never),
    'auto' (the default: use the stream once it is built; build it in the background)."""
    raw = os.environ.get("NEURON_ASYNC_LAUNCH", "auto").strip().lower()
    if raw in ("0", "false", "no", "off"):
        return "0"
    if raw in ("1", "true", "yes", "on"):
        return "1"
    if raw != "auto":
        raise ValueError(f"NEURON_ASYNC_LAUNCH={raw!r}: use 0, 1 or auto")
    return "auto"


_enabled = async_launch_setting() != "0"


def set_enabled(enabled: bool) -> bool:
    """Use the stream (when built) from now on, or not; returns the previous setting.
    NEURON_ASYNC_LAUNCH sets the initial value."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def stream_module():
    """The compiled stream module, or None (launches then run on the issuing thread)."""
    if _module is not None:
        return _module if _enabled else None
    if not _enabled:
        return None
    if async_launch_setting() == "1":
        build()
    elif _builder is None and not _failed and _module is None:
        _try_load_built()
    return _module if _enabled else None


def stream_status() -> str:
    if not _enabled:
        return "off (NEURON_ASYNC_LAUNCH=0 or set_enabled(False)): launches run on the issuing thread"
    return _status


def build(background: bool = False) -> None:
    """Compile (or load the already compiled) stream extension."""
    global _builder, _status
    if background:
        with _lock:
            if _builder is None and _module is None:
                _status = "building in the background: launches run on the issuing thread until it is built"
                _builder = threading.Thread(target=_build, name="neuron-stream-build", daemon=True)
                _builder.start()
        return
    _build()


def _build() -> None:
    global _module, _status, _failed
    with _lock:
        if _module is not None or _failed:
            return
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            _module = load(_NAME, [_SOURCE], extra_cflags=["-O2"], build_directory=_build_dir(),
                           verbose=False)
            _status = "async: launches run on the device stream's worker thread"
        except Exception as exc:  # no compiler, no ninja: launches stay on the issuing thread
            _failed = True
            _status = f"sync: the stream extension could not be built ({type(exc).__name__}: {exc})"


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package's binary sits beside it otherwise."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _try_load_built() -> None:
    """Load the extension if a previous run compiled it; else start building it in the background."""
    if os.path.exists(os.path.join(_build_dir(), f"{_NAME}.so")):
        _build()
    else:
        build(background=True)


def _build_dir() -> str:
    path = os.environ.get("NEURON_STREAM_BUILD_DIR")
    if not path:
        from torch.utils.cpp_extension import _get_build_directory

        path = _get_build_directory(_NAME, verbose=False)
    os.makedirs(path, exist_ok=True)
    return path
