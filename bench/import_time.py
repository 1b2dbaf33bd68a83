"""`import torch`'s wall time with adaptive-eager installed and without (issue 33's figure):
`python bench/import_time.py PYTHON_WITH PYTHON_WITHOUT [--runs 20]`, two interpreters of
environments that differ only in adaptive-eager (e.g. a copy of the venv with it uninstalled).

Each run is a fresh process started from a temporary folder (not the repository, whose
folders would be importable), the two interleaved so that a busy machine slows both alike.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("with_package")
    parser.add_argument("without_package")
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    pythons = {"installed": args.with_package, "not installed": args.without_package}
    times: dict[str, list[float]] = {name: [] for name in pythons}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.runs):
            for name, python in pythons.items():
                start = time.perf_counter()
                subprocess.run([python, "-c", "import torch"], check=True, cwd=folder)
                times[name].append(time.perf_counter() - start)
    for name, t in times.items():
        print(f"{name:14s} median {statistics.median(t) * 1e3:,.0f} ms (min {min(t) * 1e3:,.0f}, max {max(t) * 1e3:,.0f})")
    print(f"ratio {statistics.median(times['installed']) / statistics.median(times['not installed']):.2f}")


if __name__ == "__main__":
    main()
