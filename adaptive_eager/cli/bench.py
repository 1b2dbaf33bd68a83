"""`adaptive-eager bench`: run the comparison suite (bench/bench_workloads.py, pytest-benchmark)
and print one table of ratios per workload.

The suite lives in the repository's bench/ directory, beside the package; an editable
install (`pip install -e .`) finds it there. Ratios compare median times per step.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

SUITE = "bench_workloads.py"
NEURON_MODES = ("neuron-eager", "neuron-adaptive")
ANCHORS = ("lazy", "compile")
MODE_ORDER = ("cpu",) + NEURON_MODES + ANCHORS
OVERHEADS = ("modelled", "spent")


def bench_dir() -> Path:
    import adaptive_eager

    return Path(adaptive_eager.__file__).resolve().parent.parent / "bench"


def _pytest_command(suite: Path, json_path: str, quick: bool, select: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", str(suite), "--benchmark-only",
           f"--benchmark-json={json_path}", "--benchmark-quiet", "-q", "-rs",
           "-p", "no:cacheprovider", f"--rootdir={suite.parent.parent}"]
    if quick:
        cmd.append("--quick")
    if select:
        cmd += ["-k", select]
    return cmd


# -- reading the pytest-benchmark JSON -----------------------------------------------------------

def _rows(data: dict) -> dict[str, dict[tuple[str, str], dict]]:
    """workload -> {(mode, overhead): {"median_s": .., "extra": extra_info}} for our benchmarks."""
    out: dict[str, dict] = {}
    for b in data.get("benchmarks", []):
        extra = b.get("extra_info", {})
        if "workload" not in extra or "mode" not in extra:
            continue  # another file's benchmark (bench_adaptive.py ...): not ours to tabulate
        out.setdefault(extra["workload"], {})[(extra["mode"], extra.get("overhead", "n/a"))] = {
            "median_s": b["stats"]["median"], "extra": extra}
    return out


def _median(rows: dict, mode: str, overhead: str = "n/a") -> float | None:
    row = rows.get((mode, overhead))
    return row["median_s"] if row else None


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:.3f}" if num is not None and den else "-"


def _mode_lines(rows: dict) -> list[str]:
    cpu = _median(rows, "cpu")
    lines = [f"  {'mode':<18}{'overhead':<10}{'median ms':>11}{'x cpu':>8}"
             f"{'launches/step':>15}{'fused/step':>12}{'device us/step':>16}"]
    keys = sorted(rows, key=lambda k: (MODE_ORDER.index(k[0]) if k[0] in MODE_ORDER else 99, k[1]))
    for mode, overhead in keys:
        row = rows[(mode, overhead)]
        extra = row["extra"]
        line = (f"  {mode:<18}{overhead:<10}{row['median_s'] * 1e3:>11.3f}"
                f"{_ratio(row['median_s'], cpu):>8}")
        if "launches_per_step" in extra:
            line += (f"{extra['launches_per_step']:>15.2f}{extra.get('fused_launches_per_step', 0):>12.2f}"
                     f"{extra['device_us_per_step']:>16.1f}")
        lines.append(line)
    return lines


def _ratio_lines(rows: dict) -> list[str]:
    cpu = _median(rows, "cpu")
    settings = [o for o in OVERHEADS if any(k[1] == o for k in rows)] or ["modelled"]
    lines = ["  ratios of median times" + "".join(f"{o:>12}" for o in settings)]
    for label, num, den in (("adaptive/eager", "neuron-adaptive", "neuron-eager"),
                            ("adaptive/cpu", "neuron-adaptive", "cpu"),
                            ("eager/cpu", "neuron-eager", "cpu")):
        cells = "".join(f"{_ratio(_median(rows, num, o), _median(rows, den, o) if den != 'cpu' else cpu):>12}"
                        for o in settings)
        lines.append(f"  {label:<23}{cells}")
    for anchor in ANCHORS:
        lines.append(f"  {anchor + '/cpu':<23}{_ratio(_median(rows, anchor), cpu):>12}")
    return lines


def format_tables(data: dict) -> str:
    """One table per workload (in the suite's order) from a pytest-benchmark JSON dict."""
    tables = _rows(data)
    failures = data.get("anchor_failures", [])
    order = list(tables) + [f["workload"] for f in failures if f["workload"] not in tables]
    if not order:
        return "no benchmark of the comparison suite in this result (did -k select nothing?)"
    blocks = []
    for workload in order:
        rows = tables.get(workload, {})
        lines = [f"== {workload} =="]
        if rows:
            lines += _mode_lines(rows) + [""] + _ratio_lines(rows)
        for f in failures:
            if f["workload"] == workload:
                lines.append(f"  anchor {f['mode']} FAILED: {f['error']}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def format_summary(data: dict) -> str:
    """Adaptive/eager per workload and launch-overhead setting, each said to be below 1 (the
    adaptive engine the faster choice) or not: the comparison the engine exists for (issue 35)."""
    cells = []
    for workload, rows in _rows(data).items():
        for o in OVERHEADS:
            adaptive, eager = _median(rows, "neuron-adaptive", o), _median(rows, "neuron-eager", o)
            if adaptive and eager:
                cells.append((workload, o, adaptive / eager))
    if not cells:
        return "adaptive/eager: no workload timed both neuron modes"
    lines = ["adaptive/eager, median times (below 1: adaptive mode is the faster choice)"]
    for workload, overhead, ratio in cells:
        verdict = "below 1" if ratio < 1 else "NOT below 1: adaptive mode is the slower choice here"
        lines.append(f"  {workload:<20}{overhead:<10}{ratio:>7.3f}  {verdict}")
    below = sum(ratio < 1 for _, _, ratio in cells)
    lines.append(f"  {below} of {len(cells)} below 1")
    return "\n".join(lines)


def _settings_note(data: dict) -> str:
    for b in data.get("benchmarks", []):
        us = b.get("extra_info", {}).get("launch_overhead_us_setting")
        if us is not None:
            return (f"launch overhead {us:g} us per launch; 'modelled' adds it to the device clock "
                    f"only, 'spent' also spins it in wall-clock time. Ratios < 1 mean faster.")
    return "Ratios < 1 mean faster."


# -- the command -----------------------------------------------------------------------------------

def cmd_bench(args) -> int:
    bench = bench_dir()
    suite = bench / SUITE
    if not suite.is_file():
        print(f"adaptive-eager bench: the benchmark suite is not installed ({suite} is missing). It "
              f"lives in the repository's bench/ directory: run this command from an editable "
              f"install (`pip install -e '.[test]'` in a checkout of adaptive-eager).", file=sys.stderr)
        return 2
    json_path = args.json
    if json_path is None:
        fd, json_path = tempfile.mkstemp(prefix="adaptive-eager-bench-", suffix=".json")
        os.close(fd)
    cmd = _pytest_command(suite, json_path, args.quick, args.select)
    print(f"running the comparison suite{' (quick)' if args.quick else ''}: {shlex.join(cmd[1:])}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="adaptive-eager-bench-") as tmp:
        failures_path = Path(tmp) / "anchor_failures.json"
        env = dict(os.environ, ADAPTIVE_EAGER_BENCH_FAILURES=str(failures_path))
        code = subprocess.run(cmd, cwd=bench.parent, env=env).returncode
        failures = _read_json(failures_path)
    data = _read_json(Path(json_path))
    if data is None and failures is None:
        print(f"adaptive-eager bench: pytest exited with {code} and wrote no results "
              f"({json_path}); see its output above.", file=sys.stderr)
        return code or 1
    if data is None:  # every selected benchmark was skipped: pytest-benchmark wrote nothing
        data = {"benchmarks": []}
    if "anchor_failures" not in data:
        data["anchor_failures"] = failures or []
        Path(json_path).write_text(json.dumps(data, indent=2))
    print()
    print(format_tables(data))
    print()
    print(format_summary(data))
    print()
    print(_settings_note(data))
    print(f"raw pytest-benchmark JSON: {json_path}")
    if code == 5:
        print(f"adaptive-eager bench: -k {args.select!r} matched no benchmark; ids look like "
              f"'mlp-train-neuron-adaptive-spent' or 'decode-compile'.", file=sys.stderr)
    elif code != 0:
        print(f"adaptive-eager bench: pytest exited with {code} (failures above); the tables show "
              f"what ran.", file=sys.stderr)
    return code


def _read_json(path: Path):
    """The parsed file, or None if it is missing or empty (or not JSON)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="run the comparison suite (pytest-benchmark) and print ratio tables")
    p.add_argument("--quick", action="store_true", help="fewer rounds: a few minutes on 2 cores")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the raw pytest-benchmark JSON here (default: a temporary file)")
    p.add_argument("-k", dest="select", metavar="EXPR", default=None,
                   help="pytest -k expression over ids like 'mlp-train-neuron-adaptive-spent', "
                        "e.g. \"mlp-train and not lazy and not compile\"")
    p.set_defaults(func=cmd_bench)
