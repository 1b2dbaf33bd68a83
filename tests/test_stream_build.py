"""Building the device stream never gets in a program's way (Note [Building the stream]).

Each test runs programs in fresh processes against a build directory of its own
(NEURON_STREAM_BUILD_DIR): a build killed midway, a lock file whose owner is gone, two first
runs at once, a changed source. Builders a test started are killed when it ends, with their
compilers (each builder leads a process group of its own).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from device import stream
from device._stream_build import lock_is_held
from neuron_tensors import NATIVE
from subproc import SUBPROCESS_TIMEOUT_S, result_of, run_json, start_json

# The wrapper's stream is a module built at run time; native tensors' is in the device
# extension, built at install (Note [The device stream] in device/csrc/queue.cpp).
pytestmark = pytest.mark.skipif(NATIVE, reason="the wrapper's run-time-built stream module")

# An adaptive training loop that also runs in eager mode: same values either way, whether its
# launches run on the stream or on the issuing thread. `stream._SOURCE` is swapped first when
# SOURCE is set (a changed source, as after an upgrade).
LOOP = textwrap.dedent("""
    import os, torch, adaptive_eager
    from device import stream
    if os.environ.get("SOURCE"):
        stream._SOURCE = os.environ["SOURCE"]
        stream._NAME = stream._name_of(stream._SOURCE)
    def loop(mode):
        adaptive_eager.set_mode(mode)
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to("neuron")
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        x, y = torch.randn(8, 16).to("neuron"), torch.randn(8, 4).to("neuron")
        adaptive_eager.reset_stats()
        for _ in range(12):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()
        return [p.detach().cpu() for p in net.parameters()], adaptive_eager.stats().stream_launches
    def report(**more):
        adaptive, on_stream = loop("adaptive")
        eager, _ = loop("eager")
        builder = stream._builder.pid if stream._builder is not None else None
        emit(dict(same=all(torch.equal(a, b) for a, b in zip(adaptive, eager)), on_stream=on_stream,
                  status=stream.stream_status(), builder=builder, **more))
""")


@pytest.fixture
def build_dir(tmp_path):
    """An empty build directory; a builder still at work in it when the test ends is killed."""
    directory = tmp_path / "stream-build"
    directory.mkdir()
    yield directory
    lock = directory / f"{stream._NAME}.lock"
    for _ in range(50):  # the holder of the lock is the builder at work (its pid is in the file)
        if not lock_is_held(str(lock)):
            break
        text = lock.read_text().strip()
        if text.isdigit():
            _kill_group(int(text))
        time.sleep(0.1)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _env(directory, **more) -> dict[str, str]:
    return {"NEURON_STREAM_BUILD_DIR": str(directory), "NEURON_ASYNC_LAUNCH": "auto", **more}


def _run(directory, code: str, **env):
    return run_json(LOOP + textwrap.dedent(code), env=_env(directory, **env))


def _start_builder(directory) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, stream._BUILDER, str(directory), stream._NAME, stream._SOURCE],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


def _wait_for(predicate, what: str, timeout: float = SUBPROCESS_TIMEOUT_S) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def test_a_build_killed_midway_does_not_block_the_next_run(build_dir):
    directory = build_dir
    builder = _start_builder(directory)
    # Midway: compiling in its private directory, torch's build lock (FileBaton) taken there.
    _wait_for(lambda: any((d / "lock").exists() for d in directory.glob("tmp-*")), "the compile to start")
    _kill_group(builder.pid)
    builder.wait(timeout=SUBPROCESS_TIMEOUT_S)
    assert list(directory.glob("tmp-*/lock")), "the killed build left torch's build lock behind"
    out = _run(directory, "report()")
    assert out["same"], "adaptive mode gave other values than eager"
    assert out["on_stream"] == 0  # nothing built yet: launches on the issuing thread
    assert out["status"].startswith("building in the background"), out["status"]


def test_a_stale_lock_file_whose_owner_is_gone_does_not_block(build_dir):
    directory = build_dir
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (directory / f"{stream._NAME}.lock").write_text(f"{dead.pid}\n")  # as a killed builder leaves it
    (directory / "lock").write_text("")  # and torch's FileBaton, which wedged every later run
    out = _run(directory, "report()")
    assert out["same"] and out["on_stream"] == 0
    assert out["builder"] is not None, out["status"]  # the lock was seen as free: a build started
    assert out["status"].startswith("building in the background"), out["status"]


def test_concurrent_first_runs_build_once_and_both_use_the_stream(build_dir):
    directory = build_dir
    procs = [start_json(LOOP + "stream.build(wait=True)\nreport()\n", env=_env(directory)) for _ in range(2)]
    outs = [result_of(p) for p in procs]
    for out in outs:
        assert out["same"], out
        assert out["on_stream"] > 0, out["status"]  # both ended up on the stream
    log = (directory / f"{stream._NAME}.log").read_text()
    assert len(re.findall(r"compiling", log)) == 1, log  # built once


def test_a_changed_source_is_rebuilt_in_the_background_while_the_loop_runs_on_the_host(build_dir, tmp_path):
    directory = build_dir
    if stream.stream_module() is not None:  # the current source's build is there: only the new one is missing
        shutil.copy(stream.build_paths()["so"], directory / f"{stream._NAME}.so")
    changed = tmp_path / "_stream.cpp"
    changed.write_text(open(stream._SOURCE).read() + "\n// a changed source: another build\n")
    out = _run(directory, """
        first = loop("adaptive")[1]
        t0 = __import__("time").monotonic()
        stream.build(wait=True)  # the build started in the background at the first launch
        report(first=first, waited=__import__("time").monotonic() - t0)
    """, SOURCE=str(changed))
    assert out["first"] == 0  # while it built, the loop ran on the host
    assert out["same"] and out["on_stream"] > 0, out["status"]  # and once built, on the stream


def test_a_failed_build_leaves_launches_on_the_issuing_thread_and_says_why(build_dir):
    directory = build_dir
    out = _run(directory, "stream.build(wait=True)\nreport()", CXX="/bin/false")
    assert out["same"] and out["on_stream"] == 0
    assert out["status"].startswith("sync: the stream extension could not be built"), out["status"]
    assert "adaptive-eager build-stream" in out["status"]
    assert (directory / f"{stream._NAME}.failed").exists()
    again = _run(directory, "report()", CXX="/bin/false")  # a later run does not retry it
    assert again["builder"] is None and again["status"].startswith("sync:"), again
