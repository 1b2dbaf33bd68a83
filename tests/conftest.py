import sys

import pytest
import torch

import adaptive_eager
from adaptive_eager.mode import SWITCH
from device import stream
from dispatch.context import CONTEXT

# tests/native/ holds the native tensors' own tests (NEURON_TENSORS=native, the default).
NATIVE_TENSORS = CONTEXT.runtime.config.native_tensors
collect_ignore = [] if NATIVE_TENSORS else ["native"]
DEFAULT_MODE = adaptive_eager.get_mode()  # NEURON_ADAPTIVE_EAGER's, before any test ran


def pytest_configure(config):
    # Every test runs with the device stream (compiled once per machine, ~40 s) unless
    # NEURON_ASYNC_LAUNCH=0: built now, not in the background halfway through the run.
    if stream.async_launch_setting() != "0" and stream.stream_module() is None:
        print("building the device stream (C++, once per machine, about 40 s) ...", file=sys.stderr, flush=True)
        stream.build(wait=True)


def pytest_report_header(config):
    return f"adaptive-eager device stream: {stream.stream_status()}"


@pytest.fixture(autouse=True)
def _fresh_counters():
    """Each test starts in the default mode with zeroed counters, a seeded device and an
    engine that has seen nothing (a mode, traces, backoff and history that earlier tests
    left must not steer this one)."""
    adaptive_eager.set_mode(DEFAULT_MODE)
    torch.manual_seed(0)
    adaptive_eager.reset_stats()  # also launches anything still pending
    SWITCH.adaptive.reset()
    yield
