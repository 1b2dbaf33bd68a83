"""A debugger stopped inside a neuron model's forward shows the values CPU shows.

The same script runs twice in a subprocess, once with device cpu and once with neuron,
stopping at a `breakpoint()` in `forward`; pdb commands are piped on stdin. Every `p`
(a host read: item, tolist, repr, format) must print what CPU prints, and training must
carry on to the same result after `c`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from subproc import SUBPROCESS_TIMEOUT_S

SCRIPT = textwrap.dedent('''
    import sys

    import torch
    import adaptive_eager  # noqa: F401  (import torch alone registers neuron; be explicit)
    from torch import nn

    device = sys.argv[1]


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 3), nn.Linear(3, 2)

        def forward(self, x):
            h = torch.tanh(self.fc1(x))
            breakpoint()
            return self.fc2(h)


    torch.manual_seed(0)
    model = Net().to(device)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1)).to(device)
    loss = model(x).square().sum()
    loss.backward()
    print("AFTER", repr((loss.item(), model.fc1.weight.grad.sum().item())))
''')

# One `p` per line: pdb prints "(Pdb) " before reading each command, so the output splits
# into one chunk per command.
COMMANDS = [
    "p x.sum().item()",
    "p h.tolist()",
    "p h",
    "p f'{h.mean():.6f}'",
    "p (h < -0.1).sum().item()",
    "p self.fc1.weight[0, 1].item()",
    "p h.device.type",
    "c",
]


def _debug_session(tmp_path, device: str) -> list[str]:
    """stdout of the script under pdb, split into the output of each command."""
    script = tmp_path / "debug_me.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONBREAKPOINT="pdb.set_trace", PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(
            [sys.executable, "-u", str(script), device], input="\n".join(COMMANDS) + "\n",
            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env, cwd=tmp_path)
    except subprocess.TimeoutExpired as e:  # never hang the suite on an interactive prompt
        pytest.fail(f"the debug session on {device} did not finish: {e.stdout!r} {e.stderr!r}")
    assert done.returncode == 0, f"{device}: exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    chunks = done.stdout.split("(Pdb) ")
    assert len(chunks) == len(COMMANDS) + 1, f"{device}: the breakpoint was not hit once:\n{done.stdout}"
    return [c.strip() for c in chunks[1:]]


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("debugger")
    return {device: _debug_session(tmp, device) for device in ("cpu", "neuron")}


def test_breakpoint_in_forward_prints_the_cpu_values(sessions):
    cpu, neuron = sessions["cpu"], sessions["neuron"]
    # every p except the tensor repr and the device name is the same text on both devices
    for i, command in enumerate(COMMANDS[:-1]):
        if command in ("p h", "p h.device.type"):
            continue
        assert neuron[i] == cpu[i], f"{command!r}: neuron printed {neuron[i]!r}, cpu {cpu[i]!r}"
    assert float(neuron[0]) != 0.0 and 0.0 not in eval(neuron[1])[0]  # real values, not zeros


def test_printing_a_tensor_in_pdb_shows_its_values_and_device(sessions):
    cpu_repr, neuron_repr = sessions["cpu"][2], sessions["neuron"][2]
    assert neuron_repr.startswith("tensor(")
    # Same digits as CPU; only the device (and the line wrapping it shifts) differs.
    words = lambda s: " ".join(s.split())
    assert words(neuron_repr).endswith("device='neuron:0', grad_fn=<TanhBackward0>)")
    assert words(neuron_repr).replace(" device='neuron:0',", "") == words(cpu_repr)
    assert sessions["neuron"][6] == "'neuron'" and sessions["cpu"][6] == "'cpu'"


def test_training_continues_after_the_debugger_with_cpu_results(sessions):
    cpu_after, neuron_after = sessions["cpu"][-1], sessions["neuron"][-1]
    assert cpu_after.startswith("AFTER ")
    assert neuron_after == cpu_after


# -- in a training loop, adaptive mode -----------------------------------------------------

LOOP_SCRIPT = textwrap.dedent('''
    import json
    import sys

    import torch
    import adaptive_eager
    from torch import nn

    STOP_AT = 6


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)
            self.step = 0

        def forward(self, x):
            h = torch.relu(self.fc1(x))
            if self.step == STOP_AT:
                breakpoint()
            return self.fc2(h)


    torch.manual_seed(0)
    model = Net().to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).to("neuron")
    launches, losses = [], []
    for step in range(14):
        model.step = step
        before = adaptive_eager.stats().launches
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        launches.append(adaptive_eager.stats().launches - before)
    print("RESULT", json.dumps({"launches": launches, "losses": [l.item() for l in losses],
                                "mode": adaptive_eager.get_mode()}))
''')

LOOP_COMMANDS = ["p h.sum().item()", "p h[0, :3].tolist()", "p self.fc1.weight[0, 0].item()", "c"]


def _loop_session(tmp_path, mode_env: str) -> tuple[list[str], dict]:
    import json

    script = tmp_path / "loop.py"
    script.write_text(LOOP_SCRIPT)
    env = dict(os.environ, PYTHONBREAKPOINT="pdb.set_trace", PYTHONUNBUFFERED="1",
               NEURON_ADAPTIVE_EAGER=mode_env)
    done = subprocess.run([sys.executable, "-u", str(script)], input="\n".join(LOOP_COMMANDS) + "\n",
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out, _, result = done.stdout.rpartition("RESULT ")
    chunks = out.split("(Pdb) ")
    assert len(chunks) == len(LOOP_COMMANDS) + 1, done.stdout
    return [c.strip() for c in chunks[1:-1]], json.loads(result)


def test_breakpoint_in_an_adaptive_loop_shows_eager_values_and_fusion_resumes(tmp_path):
    eager_printed, eager = _loop_session(tmp_path, "0")
    adaptive_printed, adaptive = _loop_session(tmp_path, "1")
    assert (eager["mode"], adaptive["mode"]) == ("eager", "adaptive")
    assert adaptive_printed == eager_printed and all(eager_printed)
    assert adaptive["losses"] == eager["losses"]
    # The debugger's reads cut the trace at step 6; the very next step is back to one launch
    # (issue 15's recovery).
    assert adaptive["launches"][3:6] == [1, 1, 1]
    assert adaptive["launches"][6 + 1:] == [1] * (14 - 7), adaptive["launches"]
