"""The device's stream: fused launches run on a worker thread while the host issues on.

A real accelerator runs a launch while the host goes on issuing the next ones; only a read
of a result (or an explicit synchronize) makes the host wait. The emulated device does the
same with `_stream.cpp`: a C++ worker thread that runs the boxed ATen calls of a launch
in issue order and never takes the GIL, so the host's Python and the launch's kernels use
two cores. (A Python thread cannot: measured in bench/feasibility/device_thread_overlap.py,
its GIL hand-offs made overlap slower than running one after the other.)

The extension is compiled once per machine with torch.utils.cpp_extension (g++ and ninja,
~40 s) into NEURON_STREAM_BUILD_DIR (default: torch's extension cache), by a process of its
own (`_stream_build.py`, Note [Building the stream]): the program that needs it never
compiles, never waits and never holds a lock. It goes on with launches on the issuing
thread, with the same results, and loads the finished module (a dlopen) at a later launch.
Where it cannot be built (no compiler) or with NEURON_ASYNC_LAUNCH=0, launches stay on the
issuing thread. `stream_status()` says which it is, and why.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import threading
import time

from ._stream_build import lock_is_held

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stream.cpp")
_BUILDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stream_build.py")
# How often a launch looks whether a background build has finished (a stat call).
_POLL_S = 0.5
# A builder that exits without a module or a failure (killed) is started again this often.
_MAX_BUILDERS = 3
# How long build(wait=True) waits for a build (one takes ~40 s; a loaded machine, longer).
_WAIT_S = 900.0


def _name_of(source: str) -> str:
    with open(source, "rb") as f:
        # Named by its source: a build of another version is never loaded (nor rebuilt in the way).
        return "adaptive_eager_stream_" + hashlib.sha1(f.read()).hexdigest()[:10]


_NAME = _name_of(_SOURCE)

_lock = threading.Lock()
_module = None
_status = "not loaded yet: launches run on the issuing thread"
_failed = False  # the build failed (NAME.failed) or never finished: not tried again here
_builder: subprocess.Popen | None = None
_builders_started = 0
_next_look = 0.0


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


def enabled() -> bool:
    """Whether launches may use a device stream (NEURON_ASYNC_LAUNCH, set_enabled). Native
    tensors' stream is built with the device extension (csrc/queue.cpp), never at run time."""
    return _enabled


def stream_module():
    """The compiled stream module, or None (launches then run on the issuing thread).
    Never builds here and never waits, except with NEURON_ASYNC_LAUNCH=1 (asked for)."""
    global _next_look
    if _module is not None:
        return _module if _enabled else None
    if not _enabled or _failed:
        return None
    if async_launch_setting() == "1":
        build(wait=True)
    else:
        now = time.monotonic()
        if now >= _next_look:
            _next_look = now + _POLL_S
            if _lock.acquire(blocking=False):  # another thread looking now: not this launch
                try:
                    _advance()
                finally:
                    _lock.release()
    return _module if _enabled else None


def stream_status() -> str:
    if not _enabled:
        return "off (NEURON_ASYNC_LAUNCH=0 or set_enabled(False)): launches run on the issuing thread"
    return _status


def build_paths() -> dict[str, str]:
    """Where this source's stream module, its failure record, build log and lock live."""
    directory = _build_dir()
    return {kind: os.path.join(directory, f"{_NAME}.{kind}") for kind in ("so", "failed", "log", "lock")}


def build(wait: bool = True, retry: bool = False) -> None:
    """Load the stream module, starting its build (in its own process) if none is under way;
    with wait, until it is loaded or the build has failed. retry: forget an earlier failure."""
    global _failed, _builders_started
    with _lock:
        if retry:
            _failed, _builders_started = False, 0
            _remove(build_paths()["failed"])
        _advance()
        if not wait:
            return
        end = time.monotonic() + _WAIT_S
        while _module is None and not _failed:
            if time.monotonic() > end:
                _give_up(f"the build did not finish in {_WAIT_S:.0f} s (see {build_paths()['log']})")
                return
            time.sleep(0.2)
            _advance()


def _advance() -> None:
    """One look at the build, under _lock: load a finished module, record a failure, or make
    sure a builder is at work (ours, or another process's)."""
    global _builder, _builders_started, _status
    if _module is not None or _failed:
        return
    paths = build_paths()
    if os.path.exists(paths["so"]):
        _load(paths["so"])
        return
    if os.path.exists(paths["failed"]):
        with open(paths["failed"]) as f:
            _give_up(f"the stream extension could not be built ({f.read().strip()[:2000]})")
        return
    if _builder is not None and _builder.poll() is None:
        return  # ours is at work
    if lock_is_held(paths["lock"]):
        _status = (f"building in another process (lock {paths['lock']}): launches run on the "
                   f"issuing thread until it is built")
        return
    if _builders_started >= _MAX_BUILDERS:
        _give_up(f"{_builders_started} builds ended without a module or an error (killed?); "
                 f"see {paths['log']}")
        return
    _builder = _start_builder(paths)
    _builders_started += 1
    _status = (f"building in the background (pid {_builder.pid}, log {paths['log']}): launches run "
               f"on the issuing thread until it is built")


def _start_builder(paths) -> subprocess.Popen:
    env = dict(os.environ)
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # the builder must not load us (nor build again)
    with open(paths["log"], "a") as log:
        # Its own session: a Ctrl-C meant for the program does not stop the build, which then
        # serves the next run. The builder needs no lock held by us, so killing either is safe.
        return subprocess.Popen([sys.executable, _BUILDER, os.path.dirname(paths["so"]), _NAME, _SOURCE],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True, close_fds=True)


def _load(path: str) -> None:
    global _module, _status
    try:
        spec = importlib.util.spec_from_file_location(_NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # a module of another torch build, a truncated file: not ours to use
        _give_up(f"the stream module {path} does not load ({type(exc).__name__}: {exc}); remove it "
                 f"to rebuild")
        return
    _module = module
    _status = f"async: launches run on the device stream's worker thread ({path})"


def _give_up(why: str) -> None:
    global _failed, _status
    _failed = True
    _status = f"sync: {why}. Launches run on the issuing thread; `adaptive-eager build-stream` retries"


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _build_dir() -> str:
    path = os.environ.get("NEURON_STREAM_BUILD_DIR")
    if not path:
        from torch.utils.cpp_extension import _get_build_directory

        path = _get_build_directory(_NAME, verbose=False)
    os.makedirs(path, exist_ok=True)
    return path
