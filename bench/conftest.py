"""Benchmarks live in bench_*.py files; collect them when pytest is pointed at bench/.

`python -m pytest bench -q --benchmark-only` runs and times them; a plain `pytest bench`
runs each once as a test (pytest-benchmark's default without --benchmark-only still times
them, briefly); the repository's default `pytest` (testpaths = tests) never sees them.
"""
import pytest
import torch

import adaptive_eager
from adaptive_eager.device import stream


def pytest_collect_file(file_path, parent):
    # A file named on the command line is already collected by pytest itself (once is enough).
    if file_path.suffix == ".py" and file_path.name.startswith("bench_") \
            and not parent.session.isinitpath(file_path):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_report_header(config):
    return f"adaptive-eager device stream: {stream.stream_status()}"


@pytest.fixture(autouse=True)
def _one_thread_fresh_counters():
    """One intra-op thread (CPU and neuron compare the same host work), seeded, counters zeroed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    adaptive_eager.reset_stats()
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true", default=False,
                     help="bench: fewer rounds, so the whole suite runs in a few minutes "
                          "(or set ADAPTIVE_EAGER_BENCH_QUICK=1)")


_ANCHOR_FAILURES = pytest.StashKey[list]()


@pytest.fixture
def anchor_failures(request) -> list:
    """Where a benchmark records an anchor (torch._lazy, torch.compile) that failed on it."""
    return request.config.stash.setdefault(_ANCHOR_FAILURES, [])


def pytest_benchmark_update_json(config, benchmarks, output_json):
    """Anchors that failed are part of the result: keep them in the --benchmark-json file."""
    output_json["anchor_failures"] = config.stash.get(_ANCHOR_FAILURES, [])


def pytest_sessionfinish(session):
    """Also write the anchor failures where `adaptive-eager bench` asks: pytest-benchmark writes
    no JSON at all when every selected benchmark was skipped, and the failures must not vanish."""
    import json
    import os

    path = os.environ.get("ADAPTIVE_EAGER_BENCH_FAILURES")
    if path:
        with open(path, "w") as f:
            json.dump(session.config.stash.get(_ANCHOR_FAILURES, []), f)
