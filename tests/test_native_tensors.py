"""Native neuron tensors (NEURON_TENSORS=native) are chosen once per process, at registration,
so their tests run in a pytest process of their own: tests/native/, the OpInfo sweep
(forward, in-place, out=, complex) exactly as it runs on the wrapper, streams/events, the
custom kernels, and the adaptive engine's loops and semantics (test_adaptive*.py, test_training.py).
And 300 random programs give the same bits there as here, on the wrapper."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from neuron_tensors import NATIVE
from subproc import SUBPROCESS_TIMEOUT_S, child_env

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_native_tensor_suite_passes_in_a_process_of_its_own():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         os.path.join(TESTS, "native"), os.path.join(TESTS, "test_opinfo.py"),
         os.path.join(TESTS, "test_streams_events.py"), os.path.join(TESTS, "test_custom_kernels.py"),
         os.path.join(TESTS, "test_distributed_checkpoint.py"),
         # adaptive mode on native tensors (adaptive_eager/native_engine.py)
         os.path.join(TESTS, "test_adaptive.py"), os.path.join(TESTS, "test_adaptive_semantics.py"),
         os.path.join(TESTS, "test_adaptive_random.py"), os.path.join(TESTS, "test_training.py"),
         os.path.join(TESTS, "test_stream.py"),
         # what the wrapper's tests pin, on native tensors too (toward native as the default)
         os.path.join(TESTS, "test_compile.py"), os.path.join(TESTS, "test_profiler.py"),
         os.path.join(TESTS, "test_op_cost.py"), os.path.join(TESTS, "test_tensors.py")],
        env=child_env({"NEURON_TENSORS": "native"}), capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT_S, cwd=os.path.dirname(TESTS))
    tail = "\n".join(proc.stdout.splitlines()[-60:])
    assert proc.returncode == 0, f"the NEURON_TENSORS=native suite failed (exit {proc.returncode}):\n{tail}\n{proc.stderr[-3000:]}"
    # The native tests skip themselves outside a native process: none may have been skipped.
    assert "runs in the NEURON_TENSORS=native process" not in proc.stdout, tail


# -- random programs: native tensors give the wrapper's bits -----------------------------------
RANDOM_PROGRAMS = 300


def _same_but_whitespace(x):
    # The wrapper's repr indents a multi-line tensor's `device=` suffix by len("NeuronTensor(");
    # native tensors print exactly as CPU and CUDA tensors do. Only the whitespace differs.
    return re.sub(r"\s+", " ", x) if isinstance(x, str) else x


@pytest.mark.skipif(NATIVE, reason="compares a native process with this one, on the wrapper")
def test_random_programs_give_the_same_bits_on_native_tensors_as_on_the_wrapper(tmp_path):
    """test_adaptive_random's programs (views, in-place and out= writes, random ops, host reads,
    a second device, autograd, ...) run eagerly in a native process and here, on the wrapper."""
    import test_adaptive_random as programs

    path = tmp_path / "native.pt"
    code = (f"import sys, torch, adaptive_eager; sys.path.insert(0, {TESTS!r}); "
            f"import test_adaptive_random as r; "
            f"torch.save([r.run(r.generate(s), 'eager')[:4] for s in range({RANDOM_PROGRAMS})], {str(path)!r})")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env({"NEURON_TENSORS": "native"}),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    native = torch.load(path, weights_only=False)
    differing = []
    for seed in range(RANDOM_PROGRAMS):
        reads, final, rng, error = programs.run(programs.generate(seed), "eager")[:4]
        theirs = native[seed]
        assert error is None and theirs[3] is None, (seed, error, theirs[3])  # the programs themselves run
        found = programs.differences(
            ([_same_but_whitespace(x) for x in reads], final, rng, error, None),
            ([_same_but_whitespace(x) for x in theirs[0]], theirs[1], theirs[2], theirs[3], None))
        if found:
            differing.append((seed, found[:3]))
    assert not differing, differing[:5]
