"""Host time per training step: CPU, neuron eager and neuron adaptive, each in its own process
(issue 34's table): `python bench/step_overhead.py [--widths 64 256] [--rounds 3]`.

A small MLP (3 linear layers of the width, GELU, batch 16, AdamW) trains for --steps steps;
the last half are timed. The adaptive engine replays the step from about the 40th on (it
records and detects before): the default of 200 times its steady state, not its warm-up. Each (width, mode) runs in
a fresh process, because device threads in a process slow its CPU kernels (issue 34), and
the rounds interleave the modes, so that a machine busy for a while slows all of them alike.
The table gives medians over rounds: wall µs per step, its ratio to CPU's, and for neuron the
modelled device µs per step and launches per step.

`--first N` times a fresh process's first N steps instead, warm-up and all (issue 35 asks that
adaptive mode's first 30 cost at most 1.2x eager's: short scripts and tests are not to pay for
detection): the table gives each mode's median ms for them and its ratio to eager's, and the
same apart for the first step (lazy inits, the noisiest) and the rest (the engine's warm-up).

`--after-backward` measures the other figure of issue 34 instead: a 16x64 @ 64x64 CPU matmul's
median time before any neuron work and after one neuron backward, in one process.

`--threads` adds, per width and mode, what each of the process's threads (by name: the user's
`python`, autograd's `pt_autograd_N`, the device's `neuron_device` and its OpenMP workers, which
take its name) spent over the timed steps: CPU µs a step (/proc's schedstat) and voluntary
context switches a step (how often it blocked). The wall clock says how long a step took;
these say which thread it waited for, and whether threads slept and woke or spun (a worker
that spins never blocks, and its CPU time says so).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("cpu", "eager", "adaptive")


def thread_times(task_dir: str = "/proc/self/task") -> dict[int, tuple[str, int, int]]:
    """Each of the process's threads: (name, CPU ns, voluntary context switches), by thread id.
    A thread that ends while it is read is left out."""
    out = {}
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "comm")) as f:
                name = f.read().strip()
            with open(os.path.join(task_dir, tid, "schedstat")) as f:
                cpu_ns = int(f.read().split()[0])
            with open(os.path.join(task_dir, tid, "status")) as f:
                switches = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, ProcessLookupError):  # ended between the listing and the read
            continue
        out[int(tid)] = (name, cpu_ns, switches)
    return out


def per_step(before: dict, after: dict, steps: int) -> dict[str, dict[str, float]]:
    """What the threads of each name spent a step between two thread_times() readings, summed
    by name (the device's OpenMP workers take its thread's name). Each thread's own difference
    first: a thread made in between counts from zero, and one that ended in between is left
    out (its time in the steps with it; summing by name before the difference took its whole
    life off the others': the device's team, let go and made again, read near zero)."""
    out: dict[str, dict[str, float]] = {}
    for tid, (name, cpu_ns, switches) in after.items():
        _, cpu_before, switches_before = before.get(tid, (name, 0, 0))
        entry = out.setdefault(name, {"cpu_us": 0.0, "switches": 0.0, "threads": 0})
        entry["cpu_us"] += (cpu_ns - cpu_before) / steps / 1e3
        entry["switches"] += (switches - switches_before) / steps
        entry["threads"] += 1
    return out


def _child(mode: str, width: int, steps: int, first: bool = False) -> dict:
    import torch

    device = "cpu" if mode == "cpu" else "neuron"
    if device == "neuron":
        import adaptive_eager

        adaptive_eager.set_mode(mode)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width),
                                torch.nn.GELU(), torch.nn.Linear(width, 10)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, width).to(device), torch.randint(0, 10, (16,)).to(device)

    def step():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    timed = steps if first else steps // 2  # first: from the first step, the engine's warm-up timed
    for _ in range(steps - timed):
        step()
    if device == "neuron":
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
    threads_before = thread_times()
    start = time.perf_counter()
    step()
    first_step_end = time.perf_counter()  # --first: the first step alone, lazy inits and all
    for _ in range(timed - 1):
        step()
    if device == "neuron":
        torch.neuron.synchronize()
    end = time.perf_counter()
    wall_us = (end - start) / timed * 1e6
    out = {"wall_us": wall_us, "threads": per_step(threads_before, thread_times(), timed)}
    if first:
        out.update(first_step_ms=(first_step_end - start) * 1e3, rest_ms=(end - first_step_end) * 1e3)
    if device == "neuron":
        s = adaptive_eager.stats()
        out.update(device_us=s.device_time_us / timed, launches=s.launches / timed)
    return out


def _after_backward() -> dict:
    import torch

    a, b = torch.randn(16, 64), torch.randn(64, 64)

    def median_us(reps: int = 2000) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    before = median_us()
    import adaptive_eager  # noqa: F401

    model = torch.nn.Linear(64, 64).to("neuron")
    model(torch.randn(16, 64, device="neuron")).sum().backward()
    torch.neuron.synchronize()
    after = median_us()
    return {"before_us": before, "after_us": after, "ratio": after / before}


def _run(args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--first", type=int, metavar="N", help="time the first N steps of a fresh process")
    parser.add_argument("--after-backward", action="store_true")
    parser.add_argument("--threads", action="store_true", help="also each thread's CPU time and blocking a step")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "WIDTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]), args.first or args.steps, bool(args.first))))
        return
    if args.after_backward:
        r = _after_backward()
        print(f"16x64 @ 64x64 CPU matmul: {r['before_us']:.1f} us before any neuron work, "
              f"{r['after_us']:.1f} us after one neuron backward ({r['ratio']:.2f}x)")
        return
    results: dict = {}
    for _ in range(args.rounds):
        for width in args.widths:
            for mode in MODES:
                steps = ["--first", str(args.first)] if args.first else ["--steps", str(args.steps)]
                r = _run(["--child", mode, str(width), *steps])
                results.setdefault((width, mode), []).append(r)
    if args.first:
        _print_first(args, results)
        if args.threads:
            _print_threads(args, results)
        return
    print(f"| width | mode | wall us/step | vs CPU | device us/step | launches/step |  ({args.rounds} rounds, medians)")
    print("|---|---|---|---|---|---|")
    for width in args.widths:
        cpu = statistics.median(r["wall_us"] for r in results[(width, "cpu")])
        for mode in MODES:
            rs = results[(width, mode)]
            wall = statistics.median(r["wall_us"] for r in rs)
            device = f"{statistics.median(r['device_us'] for r in rs):,.1f}" if mode != "cpu" else "-"
            launches = f"{statistics.median(r['launches'] for r in rs):.1f}" if mode != "cpu" else "-"
            print(f"| {width} | {mode} | {wall:,.0f} | {wall / cpu:.2f} | {device} | {launches} |")
    if args.threads:
        _print_threads(args, results)


def _print_threads(args, results: dict) -> None:
    print(f"\n| width | mode | thread (count) | CPU us/step | blocked/step |  ({args.rounds} rounds, medians)")
    print("|---|---|---|---|---|")
    for width in args.widths:
        for mode in MODES:
            rs = results[(width, mode)]
            names = sorted({name for r in rs for name in r["threads"]})
            for name in names:
                seen = [r["threads"][name] for r in rs if name in r["threads"]]
                cpu_us = statistics.median(t["cpu_us"] for t in seen)
                if cpu_us < 1:
                    continue  # asleep throughout (the interpreter's helpers, an idle pool)
                switches = statistics.median(t["switches"] for t in seen)
                count = max(t["threads"] for t in seen)
                print(f"| {width} | {mode} | {name} ({count}) | {cpu_us:,.0f} | {switches:.1f} |")


def first_steps_table(first: int, widths: list[int], results: dict) -> list[str]:
    """--first's table: each mode's median ms for the first N steps, and apart, for its first
    step until its call returned (the process's lazy inits: kernels' first calls, threads made;
    25-100 ms in either neuron mode on a 2-core VM, the most of the spread between processes)
    and for the rest, up to the last step's sync (where the engine records, detects and starts
    to match). Each column's median is its own."""
    lines = [f"| width | mode | wall ms, first {first} steps | vs eager | vs CPU | step 0 ms | steps 1-{first - 1} ms "
             f"| vs eager |", "|---|---|---|---|---|---|---|---|"]
    for width in widths:
        def median(mode, key):
            return statistics.median(r[key] for r in results[(width, mode)])

        total = {mode: median(mode, "wall_us") * first / 1e3 for mode in MODES}
        rest = {mode: median(mode, "rest_ms") for mode in MODES}
        for mode in MODES:
            lines.append(f"| {width} | {mode} | {total[mode]:,.1f} | {total[mode] / total['eager']:.2f} | "
                         f"{total[mode] / total['cpu']:.2f} | {median(mode, 'first_step_ms'):,.1f} | {rest[mode]:,.1f} | "
                         f"{rest[mode] / rest['eager']:.2f} |")
    return lines


def _print_first(args, results: dict) -> None:
    print(f"({args.rounds} rounds, medians)")
    print("\n".join(first_steps_table(args.first, args.widths, results)))


if __name__ == "__main__":
    main()
