import pytest
import torch

import adaptive_eager
from adaptive_eager.mode import SWITCH
from adaptive_eager.device import stream

DEFAULT_MODE = adaptive_eager.get_mode()  # NEURON_ADAPTIVE_EAGER's, before any test ran


def pytest_report_header(config):
    return f"adaptive-eager device stream: {stream.stream_status()}"


@pytest.fixture(scope="module")
def fresh_dynamo():
    """For a module that compiles (`pytestmark = pytest.mark.usefixtures("fresh_dynamo")`):
    compiled code and recompile counts must not leak into (or from) other test files, and
    inductor compiles afresh: a graph from its on-disk cache would not test the code generator
    (a cached artifact hid a neuron codegen bug in a local CI run)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    previous, inductor_config.force_disable_caches = inductor_config.force_disable_caches, True
    yield
    inductor_config.force_disable_caches = previous
    torch._dynamo.reset()


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
