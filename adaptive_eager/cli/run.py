"""`adaptive-eager run script.py [args...]`: a user's unchanged script on the emulated device.

The script runs in this process as `python script.py args...` would run it (`__name__ ==
'__main__'`, its own argv, its directory first on sys.path, its exit code), and at exit,
after a `torch.neuron.synchronize()`, a report of what the emulated device did is printed
to stderr (the script's stdout stays the script's).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
import traceback

from adaptive_eager.stats import device_time_split

from .plot import PlotError

# run's options that take a value; the first other word is the script (see split_argv).
_VALUE_OPTIONS = ("--mode", "--report-file", "--plot")
_MODES = ("eager", "adaptive")


def add_parser(sub) -> None:
    """Add the `run` subcommand to the subparsers `sub` of the adaptive-eager parser."""
    # allow_abbrev=False: split_argv recognizes run's options by their full names only.
    p = sub.add_parser("run", allow_abbrev=False,
                       help="run a script on the emulated device, then report what the device did",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--mode", choices=_MODES,
                   help="execution mode (default: adaptive, or eager when NEURON_ADAPTIVE_EAGER=0)")
    p.add_argument("--report-file", metavar="FILE", help="also write the report to FILE")
    p.add_argument("--plot", metavar="FILE",
                   help="write a PNG of the device time split and the fused share (needs matplotlib)")
    p.add_argument("script", help="the Python script to run, unchanged")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, passed on verbatim")
    p.set_defaults(func=cmd_run)


def split_argv(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """(adaptive-eager's own words, the script's argv) for a `run` (or `project`) command line,
    else (argv, None).

    argparse would drop a `--` written right after the script, so the script's words are
    cut off before argparse sees them and handed to the script exactly as typed."""
    from .project import VALUE_OPTIONS as project_value_options

    value_options = {"run": _VALUE_OPTIONS, "project": project_value_options}.get(argv[0] if argv else None)
    if value_options is None:
        return argv, None
    i = 1
    while i < len(argv):
        word = argv[i]
        if word in value_options:
            i += 2
        elif word.startswith("-") and word != "-":
            i += 1  # a flag (-h, --opt=value), or an unknown option argparse will reject
            if word == "--":
                break  # `run -- script.py`: the next word is the script, whatever it looks like
        else:
            break
    if i >= len(argv):
        return argv, None  # no script: let argparse say what is missing
    return argv[:i + 1], argv[i + 1:]


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parser.parse_args(argv), with a `run` script's argv kept verbatim."""
    own, script_argv = split_argv(argv)
    args = parser.parse_args(own)
    if script_argv is not None:
        args.args = script_argv
    return args


# -- running the script -------------------------------------------------------------------------

def run_script(path: str, argv: list[str]) -> int:
    """Run `path` as `python path *argv` would and return its exit code; an exception is
    printed like Python prints it, and gives exit code 1."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return _exit_code(e.code)
    except BaseException as e:  # KeyboardInterrupt too: the report of what ran still matters
        _print_script_traceback(e, path)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return 0


def _exit_code(code) -> int:
    # Python's own rule for SystemExit: None is 0, an int is itself, anything else is printed and is 1.
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_script_traceback(error: BaseException, path: str) -> None:
    """The traceback from the script's first frame on, as `python script.py` shows it
    (the frames of runpy and of this module are noise to the user)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != path:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__, file=sys.stderr)


def _synchronize(code: int) -> int:
    """Drain the device so the report counts everything; a deferred op that fails here is
    the script's error, as it would have been at its next sync point."""
    import torch

    try:
        torch.neuron.synchronize()
    except Exception as e:  # noqa: BLE001  (any op error: report it, then the counters)
        print(f"adaptive-eager run: work still queued on the device failed at the final "
              f"synchronize: {type(e).__name__}: {e}", file=sys.stderr)
        return code or 1
    return code


# -- the report ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RunReport:
    """What the emulated device did while the script ran; `str()` is the printed report."""

    script: str
    exit_code: int
    mode: str
    stats: object  # adaptive_eager.Stats
    split: dict  # device_time_split(stats)
    explanation: object  # adaptive_eager.Explanation

    @classmethod
    def collect(cls, script: str, exit_code: int) -> "RunReport":
        import adaptive_eager

        explanation = adaptive_eager.explain()
        stats = explanation.stats
        return cls(script=script, exit_code=exit_code, mode=adaptive_eager.get_mode(), stats=stats,
                   split=device_time_split(stats), explanation=explanation)

    @property
    def fused_share(self) -> float:
        """Fraction of the intercepted ops that ran inside fused launches."""
        return self.stats.fused_ops / self.stats.ops if self.stats.ops else 0.0

    def __str__(self) -> str:
        return "\n".join(self._lines())

    def _lines(self) -> list[str]:
        from adaptive_eager.device import format_bytes

        s, total = self.stats, self.stats.device_time_us
        per_launch = f"{s.ops / s.launches:.2f} ops per launch" if s.launches else "no launch"
        parts = ", ".join(f"{name} {us:,.2f} us ({us / total:.0%})" if total else f"{name} 0 us"
                          for name, us in self.split.items())
        rule = "=" * 72
        return [
            rule,
            f"adaptive-eager run: {self.script} exited with code {self.exit_code} (mode {self.mode})",
            "emulated device, all devices, since start (or the script's last reset_stats()):",
            f"  ops          {s.ops:>12,}   ({per_launch}; {s.kernel_ops:,} of them ran in launches)",
            f"  launches     {s.launches:>12,}   ({s.fused_launches:,} fused)",
            f"  fused share  {self.fused_share:>12.1%}   ({s.fused_ops:,} of {s.ops:,} ops ran in fused launches)",
            f"  transfers    {s.transfers:>12,}   ({format_bytes(s.transfer_bytes)})",
            f"  device time  {total:>12,.1f} us  ({parts})",
            f"  peak memory  {s.peak_memory_bytes:>12,} bytes ({format_bytes(s.peak_memory_bytes)})",
            rule,
            str(self.explanation),
            rule,
        ]


def cmd_run(args) -> int:
    try:
        if args.plot:
            from .plot import require_matplotlib

            require_matplotlib(args.plot)
    except PlotError as e:
        print(f"adaptive-eager run: {e}", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"adaptive-eager run: can't open file {args.script!r}: no such file", file=sys.stderr)
        return 2
    import adaptive_eager

    if args.mode:
        adaptive_eager.set_mode(args.mode)
    code = _synchronize(run_script(args.script, args.args))
    report = RunReport.collect(args.script, code)
    sys.stdout.flush()  # the script's output first, even when both streams go to one file
    print(report, file=sys.stderr, flush=True)
    if args.report_file:
        with open(args.report_file, "w", encoding="utf-8") as f:
            f.write(f"{report}\n")
    if args.plot:
        _write_plot(args.plot, report)
    return code


def _write_plot(path: str, report: RunReport) -> None:
    from .plot import plot_run

    title = (f"adaptive-eager run {os.path.basename(report.script)} (mode {report.mode}): "
             f"{report.stats.ops:,} ops in {report.stats.launches:,} launches")
    plot_run(path, title, report.stats, report.split)
    print(f"adaptive-eager run: plot written to {path}", file=sys.stderr)
