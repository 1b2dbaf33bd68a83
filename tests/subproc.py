"""Run a snippet in a fresh Python process: for fresh registrations, environment-dependent
configuration, and paths that abort or segfault the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

RESULT_MARKER = "@@RESULT@@"
# Only a hang should ever reach it: a child that imports torch and builds or compiles can
# take minutes on a loaded 2-core machine, and a generous limit costs nothing when it passes.
SUBPROCESS_TIMEOUT_S = 900
_PRELUDE = (f"import json as _json\n"
            f"def emit(obj):\n    print({RESULT_MARKER!r} + _json.dumps(obj), flush=True)\n")


def child_env(env: dict[str, str] | None) -> dict[str, str]:
    """A copy of os.environ with env's entries added (a value of None removes the variable)."""
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return full_env


def run_python(code: str, env: dict[str, str] | None = None,
               timeout: float = SUBPROCESS_TIMEOUT_S, cwd=None) -> subprocess.CompletedProcess:
    """Run code with `python -c` in child_env(env), in the folder cwd (default: ours)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env(env),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def start_json(code: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start code that calls `emit(obj)` once; `result_of` waits for it and returns obj."""
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], env=child_env(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def communicate(proc: subprocess.Popen, timeout: float = SUBPROCESS_TIMEOUT_S, what: str = "child"):
    """proc's (stdout, stderr) once it exits; killed, and an AssertionError with both, after timeout."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{what} timed out after {timeout:.0f} s:\n{out}\n{err}") from None


def result_of(proc: subprocess.Popen, timeout: float = SUBPROCESS_TIMEOUT_S):
    out, err = communicate(proc, timeout)
    return _parse(proc.returncode, out, err)


def run_json(code: str, env: dict[str, str] | None = None, timeout: float = SUBPROCESS_TIMEOUT_S, cwd=None):
    """Run code that calls `emit(obj)` once; return obj. Fails loudly with the child's
    stderr if the child did not exit cleanly."""
    proc = run_python(_PRELUDE + textwrap.dedent(code), env, timeout, cwd)
    return _parse(proc.returncode, proc.stdout, proc.stderr)


def _parse(returncode: int, out: str, err: str):
    if returncode != 0:
        raise AssertionError(f"child exited with {returncode}:\n{out}\n{err}")
    for line in out.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise AssertionError(f"child emitted no result:\n{out}\n{err}")
