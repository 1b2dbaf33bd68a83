"""Benchmarks live in bench_*.py files; collect them when pytest is pointed at bench/.

`python -m pytest bench -q --benchmark-only` runs and times them; a plain `pytest bench`
runs each once as a test (pytest-benchmark's default without --benchmark-only still times
them, briefly); the repository's default `pytest` (testpaths = tests) never sees them.
"""
import pytest
import torch

import adaptive_eager


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(autouse=True)
def _one_thread_fresh_counters():
    """One intra-op thread (CPU and neuron compare the same host work), seeded, counters zeroed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    adaptive_eager.reset_stats()
    yield
    torch.set_num_threads(threads)
