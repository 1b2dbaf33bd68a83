"""`adaptive-eager run script.py [args]` and `--plot`, end to end in fresh processes.

The script under test is an unchanged training script with its own argparse flags; the
runner must behave like `python script.py` (name, argv, sys.path, exit code) and report
counters that agree with what the script itself reads from adaptive_eager.stats().
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from adaptive_eager.cli.main import build_parser
from adaptive_eager.cli.run import parse_args, split_argv
from subproc import SUBPROCESS_TIMEOUT_S

STEPS = 12

TRAIN_SCRIPT = """
    import argparse, json, sys
    import torch
    import adaptive_eager
    import helper_next_to_script  # found only if the script's directory is on sys.path

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--fail", action="store_true")
    opts = parser.parse_args()
    print("SCRIPT " + json.dumps({"name": __name__, "argv": sys.argv, "steps": opts.steps,
                                  "helper": helper_next_to_script.VALUE}), flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16).to("neuron"), torch.randint(0, 4, (8,)).to("neuron")
    for _ in range(opts.steps):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if opts.fail:
        raise ValueError("the script failed on purpose")
    torch.neuron.synchronize()
    s = adaptive_eager.stats()
    print("STATS " + json.dumps({"ops": s.ops, "launches": s.launches, "kernel_ops": s.kernel_ops,
                                 "fused_ops": s.fused_ops, "transfers": s.transfers,
                                 "peak": s.peak_memory_bytes}), flush=True)
    if opts.exit_code is not None:
        sys.exit(opts.exit_code)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("user_project")
    (directory / "helper_next_to_script.py").write_text("VALUE = 42\n")
    path = directory / "train.py"
    path.write_text(textwrap.dedent(TRAIN_SCRIPT))
    return str(path)


def _adaptive_eager(*args: str, prelude: str = "", cwd=None) -> subprocess.CompletedProcess:
    """`python -m adaptive_eager args...` in a fresh process; prelude runs first (to hide a module)."""
    code = f"{prelude}\nimport sys\nfrom adaptive_eager.cli.main import main\nsys.exit(main({list(args)!r}))"
    env = dict(os.environ)
    env.pop("NEURON_ADAPTIVE_EAGER", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                          env=env, cwd=cwd)


def _tagged(out: str, tag: str) -> dict:
    line = next((ln for ln in out.splitlines() if ln.startswith(tag + " ")), None)
    assert line is not None, f"the script printed no {tag} line:\n{out}"
    return json.loads(line[len(tag) + 1:])


def _report_numbers(report: str, label: str) -> list[float]:
    """The numbers on the report line `  label ...` (thousands separators removed)."""
    line = next((ln for ln in report.splitlines() if ln.startswith(f"  {label} ")), None)
    assert line is not None, f"no {label!r} line in the report:\n{report}"
    return [float(v) for v in re.findall(r"\d+(?:\.\d+)?", line[len(label) + 2:].replace(",", ""))]


@pytest.fixture(scope="module")
def adaptive_run(script, tmp_path_factory):
    report_file = tmp_path_factory.mktemp("report") / "report.txt"
    proc = _adaptive_eager("run", "--report-file", str(report_file), script, "--steps", str(STEPS))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc, report_file.read_text()


def test_run_runs_the_script_as_main_with_its_own_argv_and_directory(adaptive_run, script):
    proc, _ = adaptive_run
    seen = _tagged(proc.stdout, "SCRIPT")
    assert seen == {"name": "__main__", "argv": [script, "--steps", str(STEPS)], "steps": STEPS, "helper": 42}


def test_run_report_agrees_with_the_scripts_own_stats(adaptive_run):
    proc, report_file_text = adaptive_run
    own = _tagged(proc.stdout, "STATS")
    report = proc.stderr
    assert "exited with code 0 (mode adaptive)" in report
    assert _report_numbers(report, "ops")[0] == own["ops"] > 0
    assert _report_numbers(report, "launches")[0] == own["launches"]
    share, fused, ops = _report_numbers(report, "fused share")
    assert (fused, ops) == (own["fused_ops"], own["ops"]) and share == pytest.approx(100 * fused / ops, abs=0.05)
    assert _report_numbers(report, "transfers")[0] == own["transfers"] > 0
    assert _report_numbers(report, "peak memory")[0] == own["peak"] > 0
    total, overhead, _, kernels, _, transfers, _ = _report_numbers(report, "device time")
    assert total == pytest.approx(overhead + kernels + transfers, abs=0.05) and overhead > 0
    # The training loop repeats: the engine fused most of it, and explain() says with which trace.
    assert own["launches"] < own["ops"] / 2
    assert re.search(r"^cached traces: [1-9]", report, re.M), report
    assert re.search(r"^  trace +\d+: +\d+ ops +hits +[1-9]", report, re.M), report
    assert "recent divergences" in report
    assert report_file_text.strip() in report


def test_run_eager_mode_launches_once_per_op(script):
    proc = _adaptive_eager("run", "--mode", "eager", script, "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    own = _tagged(proc.stdout, "STATS")
    assert "(mode eager)" in proc.stderr
    assert own["launches"] == own["kernel_ops"] and own["fused_ops"] == 0
    assert own["ops"] - own["launches"] <= own["ops"] // 10  # the rest are transfers and views
    assert _report_numbers(proc.stderr, "launches")[0] == own["launches"]
    assert _report_numbers(proc.stderr, "fused share")[0] == 0.0


def test_run_propagates_the_scripts_exit_code_and_still_reports(script):
    proc = _adaptive_eager("run", script, "--steps", "2", "--exit-code", "3")
    assert proc.returncode == 3, proc.stderr
    own = _tagged(proc.stdout, "STATS")
    assert "exited with code 3" in proc.stderr
    assert _report_numbers(proc.stderr, "ops")[0] == own["ops"] > 0


def test_run_prints_the_scripts_traceback_exits_1_and_still_reports(script):
    proc = _adaptive_eager("run", script, "--steps", "2", "--fail")
    assert proc.returncode == 1
    assert "ValueError: the script failed on purpose" in proc.stderr
    # The traceback starts in the user's script, as `python train.py` would show it.
    frames = re.findall(r'^  File "([^"]+)"', proc.stderr, re.M)
    assert frames and frames[0] == script, proc.stderr
    assert "exited with code 1" in proc.stderr and _report_numbers(proc.stderr, "ops")[0] > 0


def test_run_reports_a_missing_script_without_starting():
    proc = _adaptive_eager("run", "no_such_script.py")
    assert proc.returncode == 2 and "can't open file 'no_such_script.py'" in proc.stderr


def test_run_passes_everything_after_the_script_verbatim():
    # argparse alone would drop the `--` that follows the script, and would read the
    # script's --mode as run's own.
    argv = ["run", "--mode=eager", "--plot", "p.png", "t.py", "--", "--mode", "x", "-h"]
    assert split_argv(argv) == (argv[:5], ["--", "--mode", "x", "-h"])
    args = parse_args(build_parser(), argv)
    assert (args.mode, args.plot, args.script, args.args) == ("eager", "p.png", "t.py", ["--", "--mode", "x", "-h"])
    args = parse_args(build_parser(), ["run", "--", "-dash.py", "a"])
    assert (args.script, args.args) == ("-dash.py", ["a"])
    assert split_argv(["demo", "--steps", "3"]) == (["demo", "--steps", "3"], None)


_HIDE_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None  # as if it were not installed"


@pytest.mark.parametrize("command", [["run"], ["demo", "--steps", "2"]])
def test_plot_without_matplotlib_fails_early_and_says_how_to_get_it(command, script, tmp_path):
    png = tmp_path / "out.png"
    tail = [script, "--steps", "2"] if command == ["run"] else []
    proc = _adaptive_eager(*command, "--plot", str(png), *tail, prelude=_HIDE_MATPLOTLIB)
    assert proc.returncode == 2, proc.stderr
    assert "--plot needs matplotlib: pip install 'adaptive-eager[plot]'" in proc.stderr
    assert "SCRIPT" not in proc.stdout and "training" not in proc.stdout  # nothing ran
    assert not png.exists()


def test_run_plot_writes_a_png(script, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    proc = _adaptive_eager("run", "--plot", str(png), script, "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {png}" in proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_demo_plot_writes_a_png_of_launches_per_step(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    proc = _adaptive_eager("demo", "--steps", "4", "--width", "32", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"plot written to {png}" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_demo_records_the_launches_of_every_step_for_the_plot():
    import argparse

    from adaptive_eager.cli.main import _train

    args = argparse.Namespace(steps=6, tail=3, width=16, layers=2, batch=4, data="device")
    eager, adaptive = _train("eager", args), _train("adaptive", args)
    # The steps hold every launch but those of building the model, the same in both modes.
    setup = [r.launches - sum(r.launches_per_step) for r in (eager, adaptive)]
    assert len(eager.launches_per_step) == len(adaptive.launches_per_step) == 6
    assert setup[0] == setup[1] >= 0
    # eager: the same ops every step after the first; adaptive: warm-up, then one fused launch a step
    assert len(set(eager.launches_per_step[1:])) == 1 and eager.launches_per_step[1] > 10
    assert adaptive.launches_per_step[0] == eager.launches_per_step[0]
    assert adaptive.launches_per_step[-3:] == [1, 1, 1]
