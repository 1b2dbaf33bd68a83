"""Host instructions of a fresh process's first steps, eager against adaptive, counted by
valgrind (issue 35's warm-up): `python bench/warmup_instructions.py [--steps 30] [--width 64]`.

Issue 35 asks that adaptive mode's first 30 steps of a small MLP loop cost at most 1.2x eager
mode's wall time. On a shared 2-core VM that wall time moves by 30-60% between two processes
of one build (bench/step_overhead.py --first: the first step alone spans 22-69 ms in eager
mode), so a change to the engine's warm-up of a few percent cannot be seen there. The host
threads' instructions can: callgrind counts nearly the same for the same build and inputs
(bench/per_op_instructions.py: about 5% between runs, from the threads' interleaving).

The loop is bench/step_overhead.py's (3 linear layers of the width, GELU, batch 16, AdamW),
each mode in its own process under `valgrind --tool=callgrind`. Each step runs inside its own
`functools.reduce` call, and callgrind dumps the user's thread's count after each
(`--dump-after`): the table gives, per step, the instructions the user's thread executed in
each mode and adaptive mode's excess, in millions. The autograd engine's device thread, which
runs every backward op (and, in adaptive mode, the engine's Python for them), dumps its count
from a hook on the first layer's weight's gradient, once per step: its columns are from that
point in one step to the same point in the next. The last rows sum the steps. The device's
executor runs the kernels and is not counted.

What the count does not see: time a thread spends blocked (a wait for the device sleeps, and
counts nothing), and valgrind runs one thread at a time, so a thread's spin counts what the
scheduler let it spin. The wall clock (step_overhead.py --first) says what a change is worth;
this says whether it moved the host's work, and in which steps.

About two minutes per mode (valgrind runs the process ~50x slower); the two modes run side by side.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

MODES = ("eager", "adaptive")


def _child(mode: str, width: int, steps: int) -> None:
    import torch

    import adaptive_eager

    adaptive_eager.set_mode(mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 10)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, width).to("neuron"), torch.randint(0, 10, (16,)).to("neuron")
    torch.neuron.synchronize()
    # The autograd thread dumps its count from the first layer's weight's gradient on (each step's
    # last backward op, give or take its bias): its step k is from there in step k-1 to there in k.
    model[0].weight.register_post_accumulate_grad_hook(lambda _: functools.reduce(lambda acc, _: acc, [0], None))
    functools.reduce(lambda acc, _: acc, [0], None)  # a dump here: the first step's count starts after it

    def step(_acc=None, _i=None):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(steps):
        functools.reduce(step, [0], None)  # one dump per step: its end (see the docstring)
    torch.neuron.synchronize()


def _summary(path: str) -> int:
    with open(path) as f:
        return next((int(line.split()[1]) for line in f if line.startswith("summary:")), 0)


def _measure(mode: str, width: int, steps: int) -> tuple[list[int], list[int]]:
    """The instructions per step of the user's thread and of the autograd thread."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--dump-after=*functools_reduce*",
               f"--callgrind-out-file={out}", sys.executable, __file__, "--child", mode, str(width), str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: the child failed under valgrind:\n{proc.stderr[-2000:]}")
        # Dumps after every functools.reduce, torch's imports' too: the steps' are the last, after
        # the child's mark.
        parts = sorted((int(m.group(1)), name) for name in os.listdir(tmp)
                       if (m := re.fullmatch(r"callgrind\.out\.(\d+)-01", name)))
        if len(parts) < steps + 1:
            raise SystemExit(f"{mode}: {len(parts)} dumps of the user's thread, fewer than its {steps} steps and mark")
        per_step = [_summary(os.path.join(tmp, name)) for _, name in parts[-steps:]]
        # The other thread that dumped: the autograd thread, once per step from the hook.
        hooked = sorted((int(m.group(1)), name) for name in os.listdir(tmp)
                        if (m := re.fullmatch(r"callgrind\.out\.(\d+)-(\d+)", name)) and m.group(2) != "01")
        if len(hooked) != steps:
            raise SystemExit(f"{mode}: {len(hooked)} dumps of the autograd thread, not one per step ({steps})")
        return per_step, [_summary(os.path.join(tmp, name)) for _, name in hooked]


def table(steps: int, results: dict) -> list[str]:
    eager, adaptive = results["eager"][0], results["adaptive"][0]
    eager_bw, adaptive_bw = results["eager"][1], results["adaptive"][1]
    lines = ["| step | user's thread: eager M | adaptive M | excess M | autograd's: eager M | adaptive M | excess M |",
             "|---|---|---|---|---|---|---|"]
    for i in range(steps):
        lines.append(f"| {i} | {eager[i] / 1e6:.2f} | {adaptive[i] / 1e6:.2f} | {(adaptive[i] - eager[i]) / 1e6:+.2f} "
                     f"| {eager_bw[i] / 1e6:.2f} | {adaptive_bw[i] / 1e6:.2f} | {(adaptive_bw[i] - eager_bw[i]) / 1e6:+.2f} |")
    user = {mode: sum(results[mode][0]) for mode in MODES}
    auto = {mode: sum(results[mode][1]) for mode in MODES}
    both = {mode: user[mode] + auto[mode] for mode in MODES}
    for label, counts in (("user's thread, all steps", user), ("autograd's thread, all steps", auto),
                          ("both", both)):
        lines.append(f"| {label} | {counts['eager'] / 1e6:.1f} | {counts['adaptive'] / 1e6:.1f} | "
                     f"{(counts['adaptive'] - counts['eager']) / 1e6:+.1f} ({counts['adaptive'] / counts['eager']:.2f}x) | | | |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "WIDTH", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: install it (Debian: apt-get install valgrind)")
    with ThreadPoolExecutor(len(MODES)) as pool:
        futures = {mode: pool.submit(_measure, mode, args.width, args.steps) for mode in MODES}
        results = {mode: f.result() for mode, f in futures.items()}
    print(f"Host instructions, millions: width {args.width}, the first {args.steps} steps of a fresh process")
    print("\n".join(table(args.steps, results)))


if __name__ == "__main__":
    main()
