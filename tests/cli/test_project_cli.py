"""`adaptive-eager project script.py [args]`: a training script's per-step cost on the chip, without values.

End to end in fresh processes: the same unchanged script under `run` (with bytes) and under
`project` (without) must spend the same modelled device time, step by step and in total, and
the report must say per optimizer step what the script's own counters say.
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from subproc import SUBPROCESS_TIMEOUT_S

STEPS = 6
TOKENS = 4 * 8

TRAIN_SCRIPT = """
    import json, sys
    import torch
    import torch.nn.functional as F
    import adaptive_eager
    from models import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT().to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 13, (4, 9)).to("neuron")
    for step in range(int(sys.argv[1])):
        loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, 13), idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"loss {loss.item():.4f}")
    torch.neuron.synchronize()
    print("STATS " + json.dumps({"device_time_us": adaptive_eager.stats().device_time_us,
                                 "peak": torch.neuron.max_memory_allocated(0)}), flush=True)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("user_project") / "train.py"
    path.write_text(textwrap.dedent(TRAIN_SCRIPT))
    return str(path)


def _adaptive_eager(*args: str) -> subprocess.CompletedProcess:
    code = f"import sys\nfrom adaptive_eager.cli.main import main\nsys.exit(main({list(args)!r}))"
    env = dict(os.environ)
    env.pop("NEURON_ADAPTIVE_EAGER", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(__file__)), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                          env=env)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    return proc


def _script_stats(out: str) -> dict:
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("STATS "))[6:])


def _script_device_us(out: str) -> float:
    return _script_stats(out)["device_time_us"]


def _step_rows(report: str) -> list[list[float]]:
    """The report's per-step rows: step, launches, ops, modelled ms, then the memory and rates."""
    rows = []
    for line in report.splitlines():
        if re.match(r"^\s+\d+\s+[\d,]+\s+[\d,]+\s+[\d,.]+\s", line):
            rows.append([float(v) for v in re.findall(r"\d+(?:\.\d+)?", line.replace(",", ""))])
    return rows


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_project_reports_each_step_at_the_cost_of_the_run_with_bytes(script, mode):
    with_bytes = _adaptive_eager("run", "--mode", mode, script, str(STEPS))
    projected = _adaptive_eager("project", "--mode", mode, "--tokens-per-step", str(TOKENS), script, str(STEPS))
    report = projected.stderr
    assert f"exited with code 0 (mode {mode}, profile trn2" in report
    # The script's own reading of the device's clock: the same in both runs (exactly: same ops, same sizes).
    assert _script_device_us(projected.stdout) == _script_device_us(with_bytes.stdout) > 0
    rows = _step_rows(report)
    assert [row[0] for row in rows] == list(range(STEPS))
    if mode == "adaptive":
        assert rows[-1][1] == 1  # the engine fused the step, projected as with bytes
    else:
        assert all(row[1] == row[2] for row in rows)  # one launch per op
    assert sum(row[3] for row in rows) <= _script_device_us(projected.stdout) / 1e3 + 1e-3 * STEPS
    assert f"host reads answered with a placeholder: {STEPS}" in report  # the loss.item() of each step
    peak = _script_stats(projected.stdout)["peak"]
    assert peak == _script_stats(with_bytes.stdout)["peak"] > 0  # HBM peak as with bytes
    assert f"peak memory per device (of 24.00 GiB each): neuron:0 {peak:,} bytes" in report
    assert "tokens/s and MFU" in report and "top ops by modelled roofline time" in report
    assert [line for line in projected.stdout.splitlines() if line.startswith("loss")] == ["loss 0.0000"] * STEPS


def test_project_takes_the_chip_and_its_memory_from_its_options(script):
    projected = _adaptive_eager("project", "--profile", "trn3", "--device-memory", "96GiB", "--mode", "eager",
                                script, "2")
    assert "exited with code 0 (mode eager, profile trn3, 4 device(s) of 96.00 GiB)" in projected.stderr
    assert "of 96.00 GiB each" in projected.stderr
    with_bytes = _adaptive_eager("run", "--mode", "eager", script, "2")  # trn2: another chip, other figures
    assert _script_device_us(projected.stdout) != _script_device_us(with_bytes.stdout)


def test_project_refuses_a_device_memory_it_cannot_read_naming_the_option(script, capsys):
    from adaptive_eager.cli.main import main

    assert main(["project", "--device-memory", "12XB", script, "2"]) == 2
    assert "--device-memory '12XB': NEURON_DEVICE_MEMORY='12XB' is not a size" in capsys.readouterr().err


TP_SCRIPT = """
    import sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if len(sys.argv) > 2:  # rank 0 of that many, alone, on torch's fake process group
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(sys.argv[2]))
    else:
        dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).to("neuron")
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16).to("neuron")
    for step in range(int(sys.argv[1])):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
"""


def test_project_under_torchrun_reports_rank_zero_and_writes_every_ranks_report(tmp_path):
    from subproc import communicate
    from torchrun import torchrun

    script = tmp_path / "train_tp.py"
    script.write_text(textwrap.dedent(TP_SCRIPT))
    report_file = tmp_path / "report.txt"
    job = torchrun("--no-python", "adaptive-eager", "project", "--tokens-per-step", "8", "--report-file",
                   str(report_file), str(script), "3", env={"NEURON_ADAPTIVE_EAGER": "0"})
    out, printed = communicate(job, what="torchrun")  # the reports are on stderr
    assert job.returncode == 0, f"{out}\n{printed}"
    assert printed.count("adaptive-eager project:") == 1 and "; rank 0 of 2" in printed  # one report on the terminal
    reports = [(tmp_path / f"report.txt.rank{r}").read_text() for r in range(2)]
    assert [f"; rank {r} of 2" in text for r, text in enumerate(reports)] == [True, True]
    rows = [_step_rows(text) for text in reports]
    assert len(rows[0]) == 3 and rows[0] == rows[1]  # a symmetric step: both ranks spend alike
    # The all-reduce of the row-wise layer's output and of its gradient, each priced on the link.
    assert "c10d::allreduce_" in reports[0]
    assert "MFU: 6 x parameters x tokens / step time / the devices' peak torch.float32 FLOP/s, 2 x " in reports[0]


def test_project_names_the_rank_of_a_job_on_the_fake_process_group(tmp_path):
    script = tmp_path / "train_tp.py"
    script.write_text(textwrap.dedent(TP_SCRIPT))
    report = _adaptive_eager("project", "--tokens-per-step", "8", str(script), "3", "16").stderr
    assert "; rank 0 of 16" in report  # no torchrun: the job's size is the process group's
    assert "the devices' peak torch.float32 FLOP/s, 16 x " in report
