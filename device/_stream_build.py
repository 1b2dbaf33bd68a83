"""Compile the device stream extension: run as its own process by device/stream.py.

    python _stream_build.py BUILD_DIR NAME SOURCE

Note [Building the stream]: the build is a process of its own, never a thread of the user's
program: it runs while the program goes on (its launches on the issuing thread meanwhile),
it outlives a program interrupted or killed during its first run, and no lock of it can be
left behind to wedge a later run:
- who builds: the process that holds an flock on BUILD_DIR/NAME.lock. The kernel drops the
  lock when its holder exits, however it exits (SIGKILL included), so a lock is never stale;
  a process that finds it taken exits at once (another builder is at work).
- where: a private directory BUILD_DIR/tmp-PID, so torch's own build lock (FileBaton,
  which a killed build leaves behind) is never shared; directories of earlier builders
  (dead: the lock is ours) are removed first.
- the result: NAME.so, moved into BUILD_DIR in one rename, so a reader finds the whole file
  or none; NAME is named by the source's hash, so NAME.so is always of this source.
- a failure: NAME.failed holds the compiler's message; no process retries it until it is
  removed (`adaptive-eager build-stream` does, and retries in the foreground).
This file imports only the standard library and torch.utils.cpp_extension, not our packages.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys


def lock_is_held(lock_path: str) -> bool:
    """Is a builder at work on lock_path right now (a live process holds its flock)?"""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): assume nobody builds
        return False
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock taken just to test
    return False


@contextlib.contextmanager
def exclusive(lock_path: str):
    """Yield True while holding the builder's lock, False if another process holds it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            import fcntl

            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            pass
        except OSError:
            yield False
            return
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())  # for people looking: who builds
        yield True
    finally:
        os.close(fd)


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` package's binary sits beside it otherwise."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build(build_dir: str, name: str, source: str) -> int:
    os.makedirs(build_dir, exist_ok=True)
    target = os.path.join(build_dir, f"{name}.so")
    failed = os.path.join(build_dir, f"{name}.failed")
    with exclusive(os.path.join(build_dir, f"{name}.lock")) as mine:
        if not mine or os.path.exists(target):
            return 0
        for entry in os.listdir(build_dir):  # left by builders that died: the lock is ours
            if entry.startswith("tmp-"):
                shutil.rmtree(os.path.join(build_dir, entry), ignore_errors=True)
        work = os.path.join(build_dir, f"tmp-{os.getpid()}")
        os.makedirs(work)
        print(f"pid {os.getpid()}: compiling {name} in {work}", flush=True)  # to NAME.log
        try:
            from torch.utils.cpp_extension import load

            _put_ninja_on_path()
            # load() compiles and imports; importing proves the module loads here.
            load(name, [source], extra_cflags=["-O2"], build_directory=work, verbose=False)
            os.replace(os.path.join(work, f"{name}.so"), target)
        except Exception as exc:  # a compiler error: recorded (an interrupt is not, and retries)
            with open(failed + ".tmp", "w") as f:
                f.write(f"{type(exc).__name__}: {exc}\n")
            os.replace(failed + ".tmp", failed)
            return 1
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(build(*sys.argv[1:4]))
