"""Native neuron tensors (NEURON_TENSORS=native) are chosen once per process, at registration,
so their tests run in a pytest process of their own: tests/native/, the OpInfo sweep
(forward, in-place, out=, complex) exactly as it runs on the wrapper, and streams/events."""
from __future__ import annotations

import os
import subprocess
import sys

from subproc import SUBPROCESS_TIMEOUT_S, child_env

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_native_tensor_suite_passes_in_a_process_of_its_own():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         os.path.join(TESTS, "native"), os.path.join(TESTS, "test_opinfo.py"),
         os.path.join(TESTS, "test_streams_events.py")],
        env=child_env({"NEURON_TENSORS": "native"}), capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S, cwd=os.path.dirname(TESTS))
    tail = "\n".join(proc.stdout.splitlines()[-60:])
    assert proc.returncode == 0, f"the NEURON_TENSORS=native suite failed (exit {proc.returncode}):\n{tail}\n{proc.stderr[-3000:]}"
    # The native tests skip themselves outside a native process: none may have been skipped.
    assert "runs in the NEURON_TENSORS=native process" not in proc.stdout, tail
