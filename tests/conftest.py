import pytest
import torch

import adaptive_eager
from adaptive_eager.mode import SWITCH


@pytest.fixture(autouse=True)
def _fresh_counters():
    """Each test starts with zeroed counters, a seeded device and an engine that has seen
    nothing (traces, backoff and history of earlier tests must not steer this one)."""
    torch.manual_seed(0)
    adaptive_eager.reset_stats()  # also launches anything still pending
    SWITCH.adaptive.reset()
    yield
