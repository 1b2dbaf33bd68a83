"""Host instructions per op on the 32-add chain, counted by valgrind (issue 35's breakdown):
`python bench/per_op_instructions.py [--steps 100]`.

The chain is bench_adaptive.py's per-op benchmark (`x.add_(i)` for i in 0..31 on 16 elements,
the step repeated): CPU, the eager path and adaptive mode's steady state (each op matched
in C++ and queued, one launch per step). Wall-clock per-op figures on this kind of machine
move by 20-50% between runs (neighbours share the cores); the number of instructions the
issuing thread executes does not: callgrind counts nearly the same total for the same build
and inputs, whatever else the machine does. Nearly: the threads' interleaving moves a little
of it (whether the device's thread has ended a launch when the host looks takes another
path), about 5% between two runs of one build (adaptive 14,563 and 15,365, the second on a
busy machine; CPU 18,993 and 19,911). So a change to the host path that moves it by more
than that shows here, and the wall clock (pytest-benchmark) says what it is worth.

Each mode runs in its own process under `valgrind --tool=callgrind`, one intra-op thread (as
bench/'s benchmarks), warmed up for --warmup steps; then --steps steps run inside one
`functools.reduce` call, the only span callgrind counts (`--toggle-collect`), on the issuing
thread alone (the device's executor runs the kernels on its own thread, not counted here).
The table gives instructions per op, whole and for the parts of the device's path:

- Python to return: all the issuing thread executes per `x.add_(i)`: the interpreter's loop,
  torch's binding (the Python int wrapped as a tensor), the dispatcher, and the path below
  (for CPU, the kernel itself).
- device path: the PrivateUse1 kernel (`neuron::eager_fallback`), all of it; the row below
  the table is the rest (Python, binding, dispatcher): what every device pays.
- eager: the op's plan looked up (geometry key), the issuing line noted, the op posted.
- adaptive: the op matched against the armed trace's guards, queued (its arguments captured,
  outputs made at issue), and the step's launch submitted (once per 32 ops, shared).

`--device-thread` adds the device's executor thread, which runs every kernel in eager and
adaptive mode (CPU runs its kernel on the issuing thread, inside its first row): two more runs
per mode, the whole process counted, with and without the counted steps; their difference over
the counted ops is its cost per op. The wall clock waits for whichever thread is slower.

Takes about a minute per mode (valgrind runs the process ~50x slower), twice that more with
--device-thread.
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

OPS_PER_STEP = 32
MODES = ("cpu", "eager", "adaptive")

# (label, the function whose inclusive count it is, modes it applies to). A name matches the
# start of callgrind's demangled name, so overloads and clones count under one label.
PARTS = (
    ("device path (neuron::eager_fallback)", "neuron::eager_fallback(", ("eager", "adaptive")),
    ("  eager: plan lookup (geometry_key)", "neuron::geometry_key(", ("eager",)),
    ("  eager: issuing line (issue_site)", "neuron::issue_site(", ("eager",)),
    ("  eager: posted (post_eager)", "neuron::post_eager(", ("eager",)),
    ("    of which arguments captured", "neuron::(anonymous namespace)::capture(", ("eager",)),
    ("  adaptive: matched (PositionGuards::matches)", "neuron::PositionGuards::matches(", ("adaptive",)),
    ("  adaptive: queued (enqueue)", "neuron::enqueue(", ("adaptive",)),
    ("    of which arguments captured", "neuron::(anonymous namespace)::capture(", ("adaptive",)),
    ("  adaptive: launch submitted (submit_queue)", "neuron::submit_queue(", ("adaptive",)),
)


def _child(mode: str, warmup: int, steps: int) -> None:
    import torch

    import adaptive_eager
    from adaptive_eager.device import native

    torch.set_num_threads(1)
    x = torch.zeros(16, device="cpu" if mode == "cpu" else "neuron")

    def step(_acc=None, _i=None):
        for i in range(OPS_PER_STEP):
            x.add_(i)

    with adaptive_eager.mode("eager" if mode == "cpu" else mode):
        for _ in range(warmup):
            step()
        native.wait_for_device()
        matched = native.armed_matches()
        functools.reduce(step, range(steps), None)  # the counted span (see the docstring)
        native.wait_for_device()
        if mode == "adaptive" and native.armed_matches() - matched != steps * OPS_PER_STEP:
            # Not the steady state (every op matched in C++): the table would not mean what it says.
            raise SystemExit(f"adaptive mode matched {native.armed_matches() - matched} of the "
                             f"{steps * OPS_PER_STEP} counted ops in C++: not in its steady state yet (raise --warmup)")


_LINE = re.compile(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?\S*?:(.*?)\s*(?:\[[^\]]*\])?\s*$")


def inclusive_counts(annotated: str) -> dict[str, int]:
    """{demangled function name: inclusive instructions} from `callgrind_annotate --inclusive=yes`
    output; a recursive entry (name'2) is left out, its count is inside the outer entry."""
    counts: dict[str, int] = {}
    for line in annotated.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        name = m.group(2)
        if re.search(r"'\d+$", name):  # name'2, name(args)'3: recursion, inside the outer entry
            continue
        counts[name] = max(counts.get(name, 0), int(m.group(1).replace(",", "")))
    return counts


def part_count(counts: dict[str, int], prefix: str) -> int:
    """The largest inclusive count of a function whose name starts with prefix (0 if none)."""
    return max((n for name, n in counts.items() if name.startswith(prefix)), default=0)


def _measure(mode: str, warmup: int, steps: int) -> tuple[int, dict[str, int]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=*functools_reduce*",
               "--separate-threads=yes", f"--callgrind-out-file={out}",
               sys.executable, __file__, "--child", mode, str(warmup), str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: the child failed under valgrind:\n{proc.stderr[-2000:]}")
        # One file per thread; the issuing thread is the one that counted anything.
        best = None
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            with open(path) as f:
                total = next((int(line.split()[1]) for line in f if line.startswith("totals:")), 0)
            if best is None or total > best[0]:
                best = (total, path)
        if best is None or best[0] == 0:
            raise SystemExit(f"{mode}: callgrind counted nothing inside functools.reduce")
        annotated = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", best[1]],
                                   capture_output=True, text=True, check=True).stdout
        return best[0], inclusive_counts(annotated)


def _device_thread(mode: str, warmup: int, steps: int) -> int:
    """The device's executor thread's instructions over the whole child process."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}",
               sys.executable, __file__, "--child", mode, str(warmup), str(steps)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{mode}: the child failed under valgrind:\n{proc.stderr[-2000:]}")
        # The executor: the thread that ran the kernels (the eager path's run_on_host, which a
        # fused launch's ops run through too).
        totals = []
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name)) as f:
                text = f.read()
            if "eager_detail::run_on_host" in text and not name.endswith("-01"):
                totals.append(next(int(line.split()[1]) for line in text.splitlines() if line.startswith("totals:")))
        if len(totals) != 1:
            raise SystemExit(f"{mode}: {len(totals)} threads ran kernels, not the device's executor alone")
        return totals[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="counted steps (32 ops each)")
    parser.add_argument("--warmup", type=int, default=400, help="steps before counting")
    parser.add_argument("--device-thread", action="store_true", help="count the device's executor thread too")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "WARMUP", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]), int(args.child[2]))
        return
    missing = [tool for tool in ("valgrind", "callgrind_annotate") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not found: install valgrind (Debian: apt-get install valgrind)")
    ops = args.steps * OPS_PER_STEP
    results = {mode: _measure(mode, args.warmup, args.steps) for mode in MODES}
    print(f"host instructions per op, x.add_(i) on 16 elements, {ops} ops counted by callgrind "
          f"(the issuing thread; one intra-op thread)")
    print(f"| {'':46} | {'cpu':>8} | {'eager':>8} | {'adaptive':>8} |")
    print(f"|{'-' * 48}|{'-' * 10}|{'-' * 10}|{'-' * 10}|")
    print(f"| {'Python to return (all)':46} | " + " | ".join(f"{results[m][0] / ops:8,.0f}" for m in MODES) + " |")
    for label, prefix, modes in PARTS:
        cells = [f"{part_count(results[m][1], prefix) / ops:8,.0f}" if m in modes else f"{'-':>8}" for m in MODES]
        print(f"| {label:46} | " + " | ".join(cells) + " |")
    rest = [results[m][0] - part_count(results[m][1], PARTS[0][1]) if m in PARTS[0][2] else results[m][0] for m in MODES]
    print(f"| {'all but the device path (CPU: and its kernel)':46} | " + " | ".join(f"{r / ops:8,.0f}" for r in rest) + " |")
    if args.device_thread:
        device = {m: (_device_thread(m, args.warmup, args.steps) - _device_thread(m, args.warmup, 0)) / ops
                  for m in MODES if m != "cpu"}
        label = "the device's thread (kernels, launches)"
        print(f"| {label:46} | {'-':>8} | " + " | ".join(f"{device[m]:8,.0f}" for m in MODES if m != "cpu") + " |")


if __name__ == "__main__":
    main()
