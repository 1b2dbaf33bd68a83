"""The command line, end to end in fresh processes: `adaptive-eager info` and `demo`."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from subproc import SUBPROCESS_TIMEOUT_S

STEPS = 8


def _run(args: list[str]) -> str:
    env = dict(os.environ)
    env.pop("NEURON_ADAPTIVE_EAGER", None)
    proc = subprocess.run(args, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env)
    assert proc.returncode == 0, f"{args} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _numbers(out: str, label: str) -> list[float]:
    """The numbers of the table row that starts with `label`."""
    line = next((ln for ln in out.splitlines() if ln.startswith(label)), None)
    assert line is not None, f"no row {label!r} in:\n{out}"
    return [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", line[len(label):])]


@pytest.fixture(scope="module")
def demo_output() -> str:
    return _run([sys.executable, "-m", "adaptive_eager", "demo", "--steps", str(STEPS)])


def test_demo_shows_progress_per_phase(demo_output):
    for mode in ("eager", "adaptive"):
        assert re.search(rf"^\[{mode}\] training {STEPS} steps \.\.\. done in \d+\.\d+ s$",
                         demo_output, re.M), demo_output


def test_demo_reports_bit_identical_losses_and_parameters(demo_output):
    assert re.search(r"^losses bit-identical\s+True$", demo_output, re.M), demo_output
    assert re.search(r"^parameters bit-identical\s+True$", demo_output, re.M), demo_output
    eager_loss, adaptive_loss = _numbers(demo_output, "final loss")
    assert eager_loss == adaptive_loss


def test_demo_adaptive_mode_launches_less_for_the_same_ops(demo_output):
    assert _numbers(demo_output, "steps") == [STEPS, STEPS]
    tail = STEPS // 2
    ops_e, ops_a, ops_ratio = _numbers(demo_output, f"ops/step (last {tail})")
    assert ops_e == ops_a > 0 and ops_ratio == 1.0
    for label in (f"launches/step (last {tail})", "launches/step (overall)",
                  f"device us/step (last {tail})", "device us/step (overall)"):
        eager, adaptive, ratio = _numbers(demo_output, label)
        assert 0 < adaptive < eager, f"{label}: {eager} vs {adaptive}\n{demo_output}"
        assert ratio == pytest.approx(adaptive / eager, abs=2e-3)
    # The last steps repeat the learned step: every op in them is fused.
    assert _numbers(demo_output, f"launches/step (last {tail})")[1] <= 2


def test_demo_reports_memory_wall_time_and_launch_overhead(demo_output):
    eager, adaptive, _ = _numbers(demo_output, "peak device memory (bytes)")[:3]
    assert eager > 0 and adaptive > 0
    for label in (f"wall ms/step (last {STEPS // 2})", "wall ms/step (overall)"):
        assert all(v > 0 for v in _numbers(demo_output, label))
    assert re.search(r"^launch overhead: \d+(\.\d+)? us per launch", demo_output, re.M), demo_output


def test_demo_rejects_a_single_step():
    proc = subprocess.run([sys.executable, "-m", "adaptive_eager", "demo", "--steps", "1"],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 2 and "use at least 2 steps" in proc.stdout


def test_info_lists_devices_and_launch_overhead():
    exe = shutil.which("adaptive-eager")
    assert exe is not None, "the adaptive-eager script is missing: run `pip install -e .[test]`"
    out = _run([exe, "info"])
    assert re.search(r"^adaptive-eager \S+, torch 2\.13", out, re.M), out
    devices = re.findall(r"^  neuron:(\d+) ", out, re.M)
    assert devices and devices == [str(i) for i in range(len(devices))], out
    assert re.search(r"^launch overhead: \d+(\.\d+)? us per launch", out, re.M), out
    assert "execution mode: adaptive" in out


@pytest.mark.parametrize("value, says", [(None, "unset: they use the CPU"), ("neuron", "set: they use neuron"),
                                         ("cpu", "now 'cpu': they do not use neuron")])
def test_info_says_how_hugging_face_is_pointed_at_neuron_and_whether_it_is_now(value, says):
    env = {k: v for k, v in os.environ.items() if k != "ACCELERATE_TORCH_DEVICE"}
    if value is not None:
        env["ACCELERATE_TORCH_DEVICE"] = value
    out = subprocess.run([sys.executable, "-m", "adaptive_eager", "info"], capture_output=True, text=True, env=env,
                         timeout=SUBPROCESS_TIMEOUT_S).stdout
    assert f"Hugging Face Trainer/accelerate: ACCELERATE_TORCH_DEVICE=neuron in the environment ({says})" in out, out
    assert 'PyTorch Lightning: Trainer(accelerator="neuron", devices=N)' in out
