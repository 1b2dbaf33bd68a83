"""Run a snippet in a fresh Python process: for fresh registrations, environment-dependent
configuration, and paths that abort or segfault the process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

RESULT_MARKER = "@@RESULT@@"


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run code with `python -c`; env entries are added to (a copy of) os.environ, and a
    value of None removes the variable."""
    full_env = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def run_json(code: str, env: dict[str, str] | None = None, timeout: float = 120):
    """Run code that calls `emit(obj)` once; return obj. Fails loudly with the child's
    stderr if the child did not exit cleanly."""
    prelude = (f"import json as _json\n"
               f"def emit(obj):\n    print({RESULT_MARKER!r} + _json.dumps(obj), flush=True)\n")
    proc = run_python(prelude + textwrap.dedent(code), env, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"child exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise AssertionError(f"child emitted no result:\n{proc.stdout}\n{proc.stderr}")
