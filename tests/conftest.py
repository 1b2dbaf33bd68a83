import pytest
import torch

import adaptive_eager


@pytest.fixture(autouse=True)
def _fresh_counters():
    """Each test starts with zeroed counters and a seeded device."""
    torch.manual_seed(0)
    adaptive_eager.reset_stats()
    yield
