"""`adaptive-eager project script.py [args...]`: what a training script would cost on the chip, run without its values.

The script runs as `adaptive-eager run` runs it, in projection mode (adaptive_eager.projection):
its neuron tensors carry no bytes and its ops run their shape functions, while the device's
clock and memory account as with bytes, so a full-size model is priced on this machine. Each
optimizer step is a step of the report: its launches, its modelled time, tokens per second and
MFU (with --tokens-per-step), the device memory, and the ops that took the most modelled time.
The chip is --profile's (else NEURON_PROFILE's), its memory per device --device-memory's (else
NEURON_DEVICE_MEMORY's). Under torchrun (`torchrun --nproc-per-node=8 --no-python adaptive-eager
project train.py`) each rank is projected in its process; rank 0 prints its report, and
--report-file writes each rank's (FILE.rank<N>).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import subprocess
import sys

# project's options that take a value (run.split_argv finds the script after them).
VALUE_OPTIONS = ("--mode", "--report-file", "--tokens-per-step", "--top", "--profile", "--device-memory")
_MODES = ("eager", "adaptive")


def add_parser(sub) -> None:
    """Add the `project` subcommand to the subparsers `sub` of the adaptive-eager parser."""
    p = sub.add_parser("project", allow_abbrev=False,
                       help="run a training script without its values, and report what each step would cost on the chip",
                       description=__doc__.split("\n\n")[1].replace("\n", " "))
    p.add_argument("--mode", choices=_MODES,
                   help="execution mode (default: adaptive, or eager when NEURON_ADAPTIVE_EAGER=0)")
    p.add_argument("--tokens-per-step", type=int, metavar="N",
                   help="tokens a step trains on (batch x sequence, all ranks together): the report adds tokens/s and MFU")
    p.add_argument("--top", type=int, default=8, metavar="K", help="ops listed by modelled time (default 8)")
    p.add_argument("--profile", choices=("trn2", "trn3"), help="the chip (default: NEURON_PROFILE's, trn2)")
    p.add_argument("--device-memory", metavar="SIZE",
                   help="memory per device, e.g. 96GiB (default: NEURON_DEVICE_MEMORY's, the profile's own)")
    p.add_argument("--report-file", metavar="FILE", help="also write the report to FILE")
    p.add_argument("script", help="the Python script to run, unchanged")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, passed on verbatim")
    p.set_defaults(func=cmd_project)


@dataclasses.dataclass(frozen=True)
class Step:
    """What one optimizer step spent on the modelled device (all devices)."""

    launches: int
    ops: int
    device_us: float
    memory: int  # allocated at its end
    parameters: int  # the optimizer's parameters (elements)
    dtype: object  # the parameters' dtype (the peak FLOP rate MFU is measured against)
    roofline_us: dict  # op name -> modelled roofline µs, this step


class StepRecorder:
    """Records each optimizer step's figures through torch.optim's global step hook."""

    def __init__(self):
        self.steps: list[Step] = []
        self.rank, self.world = 0, 1  # the job's, at the steps (torch's fake process group: no torchrun)
        self._last = None
        self._handle = None

    def __enter__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        import adaptive_eager
        from adaptive_eager.device import native

        native.set_op_log(True)
        self._last = adaptive_eager.stats()
        self._handle = register_optimizer_step_post_hook(self._on_step)
        return self

    def __exit__(self, *exc):
        from adaptive_eager.device import native

        self._handle.remove()
        native.set_op_log(False)
        return False

    def _on_step(self, optimizer, args, kwargs) -> None:
        import torch

        import adaptive_eager
        from adaptive_eager.device import native

        now = adaptive_eager.stats()  # waits for what was launched; what the engine holds counts next step
        roofline = collections.Counter()
        for name, us in native.take_op_log():
            roofline[name] += us
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.steps.append(Step(launches=now.launches - self._last.launches, ops=now.ops - self._last.ops,
                               device_us=now.device_time_us - self._last.device_time_us,
                               memory=now.memory_bytes, parameters=sum(p.numel() for p in params),
                               dtype=params[0].dtype if params else torch.float32, roofline_us=dict(roofline)))
        self._last = now


@dataclasses.dataclass(frozen=True)
class ProjectReport:
    """The per-step report; `str()` is what is printed."""

    script: str
    exit_code: int
    mode: str
    profile: str
    devices: int
    capacity: int
    steps: list
    stats: object  # adaptive_eager.Stats, the whole run
    peak_memory: dict  # device index -> its peak (devices that held anything)
    peak_flops: dict  # dtype -> the device's peak FLOP/s
    tokens_per_step: int | None
    top: int
    rank: int = 0  # under torchrun: this process's rank, of
    world: int = 1  # ranks, each a device

    def steady(self) -> list:
        """The steps measured for the summary: the second half (warm-up and detection are over)."""
        return self.steps[len(self.steps) // 2:] if len(self.steps) > 1 else self.steps

    def __str__(self) -> str:
        return "\n".join(self._lines())

    def _rate_columns(self, step: Step) -> str:
        if not self.tokens_per_step or step.device_us <= 0:
            return ""
        seconds = step.device_us / 1e6
        tokens_per_s = self.tokens_per_step / seconds
        # Model FLOPs of a training step, as MFU is usually reported (PaLM's 6 N per token:
        # forward and backward of every parameter, attention's own FLOPs left out), over every
        # rank's device. A sharded parameter (a DTensor) counts its whole size.
        mfu = 6 * step.parameters * self.tokens_per_step / seconds / (self.peak_flops[step.dtype] * self.world)
        return f" {tokens_per_s:>11,.0f} {mfu:>6.1%}"

    def _lines(self) -> list[str]:
        from adaptive_eager.device import format_bytes

        rule = "=" * 78
        lines = [rule,
                 f"adaptive-eager project: {self.script} exited with code {self.exit_code} (mode {self.mode}, "
                 f"profile {self.profile}, {self.devices} device(s) of {format_bytes(self.capacity)})"
                 + (f"; rank {self.rank} of {self.world}" if self.world > 1 else ""),
                 "projection: tensors carried no values; times are the cost model's, not the chip's"]
        rates = self.tokens_per_step is not None
        header = f"{'step':>5} {'launches':>9} {'ops':>7} {'modelled ms':>12} {'memory':>11}"
        if rates:
            header += f" {'tokens/s':>11} {'MFU':>6}"
        lines.append(header)
        for i, step in enumerate(self.steps):
            lines.append(f"{i:>5} {step.launches:>9,} {step.ops:>7,} {step.device_us / 1e3:>12,.3f} "
                         f"{format_bytes(step.memory):>11}" + self._rate_columns(step))
        if not self.steps:
            lines.append("  (no optimizer step: the report covers the whole run only)")
        steady = self.steady()
        if steady:
            mean = Step(launches=round(sum(s.launches for s in steady) / len(steady)),
                        ops=round(sum(s.ops for s in steady) / len(steady)),
                        device_us=sum(s.device_us for s in steady) / len(steady), memory=steady[-1].memory,
                        parameters=steady[-1].parameters, dtype=steady[-1].dtype, roofline_us={})
            lines.append(f"steady state (mean of steps {len(self.steps) - len(steady)}-{len(self.steps) - 1}): "
                         f"{mean.device_us / 1e3:,.3f} ms a step, {mean.launches:,} launches, "
                         f"{steady[-1].parameters / 1e9:.2f} B parameters ({steady[-1].dtype})")
            if rates:
                devices = f"{self.world} x " if self.world > 1 else ""
                lines.append("  tokens/s and MFU:" + self._rate_columns(mean) +
                             f"  (MFU: 6 x parameters x tokens / step time / the devices' peak {steady[-1].dtype} "
                             f"FLOP/s, {devices}{self.peak_flops[steady[-1].dtype] / 1e12:,.1f} TFLOP/s)")
            roofline = collections.Counter()
            for s in steady:
                roofline.update(s.roofline_us)
            total = sum(roofline.values())
            if total > 0:
                lines.append(f"top ops by modelled roofline time (steady steps, launch overhead apart):")
                for name, us in roofline.most_common(self.top):
                    lines.append(f"  {name:<60} {us / len(steady) / 1e3:>10,.3f} ms a step {us / total:>6.1%}")
        s = self.stats
        peaks = ", ".join(f"neuron:{i} {peak:,} bytes ({format_bytes(peak)})" for i, peak in self.peak_memory.items())
        lines += [f"whole run: {s.ops:,} ops, {s.launches:,} launches, device time {s.device_time_us:,.1f} us",
                  f"peak memory per device (of {format_bytes(self.capacity)} each): {peaks or 'none used'}",
                  f"host reads answered with a placeholder: {s.placeholder_reads:,}"
                  + (" (control flow that read them may differ from a run with values)" if s.placeholder_reads else ""),
                  rule]
        return lines


def _in_a_process_with_the_chip_asked_for(args) -> int | None:
    """--profile and --device-memory are settings the device reads once, when torch loads it
    (Note [A bad setting fails at first use]): in this process it is loaded already. If they
    ask for another chip than this process has, the command runs again in a new process with
    them in its environment (its exit code returned); None if this process will do."""
    wanted = {"NEURON_PROFILE": args.profile, "NEURON_DEVICE_MEMORY": args.device_memory}
    env = {name: value for name, value in wanted.items() if value is not None and os.environ.get(name) != value}
    if not env:
        return None
    from adaptive_eager.device import settings
    from adaptive_eager.device.errors import NeuronConfigError

    for name, value in env.items():
        try:
            settings.read(name, {name: value})
        except NeuronConfigError as e:
            option = "--profile" if name == "NEURON_PROFILE" else "--device-memory"
            print(f"adaptive-eager project: {option} {value!r}: {e}", file=sys.stderr)
            return 2
    argv = [sys.executable, "-m", "adaptive_eager", "project"]
    if args.mode:
        argv += ["--mode", args.mode]
    if args.tokens_per_step is not None:
        argv += ["--tokens-per-step", str(args.tokens_per_step)]
    if args.report_file:
        argv += ["--report-file", args.report_file]
    argv += ["--top", str(args.top), "--", args.script, *args.args]
    return subprocess.call(argv, env={**os.environ, **env})


def cmd_project(args) -> int:
    from .run import _synchronize, run_script

    code = _in_a_process_with_the_chip_asked_for(args)
    if code is not None:
        return code

    if not os.path.isfile(args.script):
        print(f"adaptive-eager project: can't open file {args.script!r}: no such file", file=sys.stderr)
        return 2
    if args.tokens_per_step is not None and args.tokens_per_step < 1:
        print(f"adaptive-eager project: --tokens-per-step must be positive, got {args.tokens_per_step}", file=sys.stderr)
        return 2
    import torch

    import adaptive_eager
    from adaptive_eager.dispatch import CONTEXT

    if args.mode:
        adaptive_eager.set_mode(args.mode)
    with adaptive_eager.projection(), StepRecorder() as recorder:
        code = _synchronize(run_script(args.script, args.args))
    runtime = CONTEXT.runtime
    dtypes = {step.dtype for step in recorder.steps} | {torch.float32}
    report = ProjectReport(
        script=args.script, exit_code=code, mode=adaptive_eager.get_mode(), profile=runtime.config.profile.name,
        devices=runtime.device_count, capacity=runtime.devices[0].memory.capacity, steps=recorder.steps,
        stats=adaptive_eager.stats(), peak_memory={i: d.memory.peak for i, d in enumerate(runtime.devices) if d.memory.peak},
        peak_flops={dt: 1e6 / runtime.cost.us_per_flop(dt) for dt in dtypes},
        tokens_per_step=args.tokens_per_step, top=args.top, rank=recorder.rank, world=recorder.world)
    sys.stdout.flush()
    if report.rank == 0:  # under torchrun, one report on the terminal: rank 0's
        print(report, file=sys.stderr, flush=True)
    if args.report_file:
        path = args.report_file if report.world == 1 else f"{args.report_file}.rank{report.rank}"
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{report}\n")
    return code
