"""The `adaptive-eager` command line."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

_MODES = ("eager", "adaptive")


def cmd_info(args) -> int:
    import torch

    import adaptive_eager  # noqa: F401  (registers the device)
    from adaptive_eager.device import format_bytes

    rt = torch.neuron
    props = rt.get_device_properties(0)
    print(f"adaptive-eager {adaptive_eager.__version__}, torch {torch.__version__}")
    print(f"profile: {props.profile}, {rt.device_count()} devices of {props.neuron_cores} NeuronCores")
    for i in range(rt.device_count()):
        p = rt.get_device_properties(i)
        print(f"  neuron:{i}  {p.name}  memory {format_bytes(p.total_memory)}")
    print(f"launch overhead: {props.launch_overhead_us:g} us per launch (modelled; an assumption, "
          f"no official figure is published)")
    print(f"execution mode: {adaptive_eager.get_mode()} (NEURON_ADAPTIVE_EAGER=0 selects eager)")
    from adaptive_eager.device import stream

    print(f"device stream: {stream.stream_status()}")
    for line in _framework_lines():
        print(line)
    return 0


def _framework_lines() -> list[str]:
    """How the libraries that choose the device themselves are pointed at neuron, and whether
    this environment does it now."""
    import importlib.util
    import os

    chosen = os.environ.get("ACCELERATE_TORCH_DEVICE")
    accelerate = ("set: they use neuron" if chosen and chosen.startswith("neuron")
                  else f"now {chosen!r}: they do not use neuron" if chosen else "unset: they use the CPU")
    lightning = importlib.util.find_spec("lightning") or importlib.util.find_spec("pytorch_lightning")
    return [
        f"Hugging Face Trainer/accelerate: ACCELERATE_TORCH_DEVICE=neuron in the environment ({accelerate})",
        "PyTorch Lightning: Trainer(accelerator=\"neuron\", devices=N) "
        f"({'installed' if lightning else 'not installed'})",
    ]


# -- demo: the same MLP training loop in eager and in adaptive mode -----------------------------

@dataclasses.dataclass
class PhaseResult:
    """What one training run did; 'tail' figures cover the last `tail` steps (steady state)."""

    losses: list  # floats, one per step
    params: list  # final parameters, on the host
    steps: int
    tail: int
    ops_tail: int
    launches_tail: int
    launches: int
    device_us_tail: float
    device_us: float
    wall_s_tail: float
    wall_s: float
    peak_memory_bytes: int
    launches_per_step: list = dataclasses.field(default_factory=list)  # for --plot
    stats: object = None  # adaptive_eager.Stats at the end of the run


def _build(width: int, layers: int, classes: int, batch: int, data_on_device: bool):
    import torch

    blocks = []
    for _ in range(layers - 1):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(width, classes)).to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(batch, width, generator=data)
    y = torch.randint(0, classes, (batch,), generator=data)
    if data_on_device:
        x, y = x.to("neuron"), y.to("neuron")
    return model, opt, x, y


def _train(mode: str, args) -> PhaseResult:
    """Train from the same seed in `mode`; no host read inside the loop (losses stay on the device)."""
    import torch

    import adaptive_eager

    with adaptive_eager.mode(mode):
        torch.manual_seed(0)  # also seeds the device generators
        adaptive_eager.reset_stats()
        model, opt, x, y = _build(args.width, args.layers, 10, args.batch, args.data == "device")
        tail_start = args.steps - args.tail
        losses, mark, mark_time, step_marks = [], None, None, []
        start = time.perf_counter()
        for step in range(args.steps):
            # wait=False: counting must not wait for the launch running beside the host
            step_marks.append(adaptive_eager.stats(wait=False).launches)
            if step == tail_start:
                # Waits for the device (not for what the engine holds back): the device runs
                # beside the host, eager ops too, and its clock is charged as ops run, so a
                # reading without the wait lags by however far the host has run ahead.
                mark, mark_time = adaptive_eager.stats(), time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x.to("neuron")), y.to("neuron"))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        # Counted before the final synchronize, as the mark: the tail then starts and ends at
        # the same point of the loop, so what the engine holds back is the same at both ends.
        end = adaptive_eager.stats()
        torch.neuron.synchronize()
        wall_end = time.perf_counter()
        total = adaptive_eager.stats()
        result = PhaseResult(
            losses=[float(v) for v in losses], params=[p.detach().cpu() for p in model.parameters()],
            steps=args.steps, tail=args.tail, ops_tail=end.ops - mark.ops,
            launches_tail=end.launches - mark.launches, launches=total.launches,
            device_us_tail=end.device_time_us - mark.device_time_us, device_us=total.device_time_us,
            wall_s_tail=wall_end - mark_time, wall_s=wall_end - start,
            peak_memory_bytes=total.peak_memory_bytes, stats=total,
            # the last step's launches include what its final synchronize ran
            launches_per_step=[b - a for a, b in zip(step_marks, step_marks[1:] + [total.launches])])
    del model, opt, x, y, losses
    gc.collect()  # the next phase's peak memory must not include this one's tensors
    return result


def _bit_identical(a: list, b: list) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _row(label: str, eager, adaptive, fmt: str, ratio: bool = True) -> str:
    cells = f"{label:<30}{format(eager, fmt):>14}{format(adaptive, fmt):>14}"
    if ratio:
        cells += f"{adaptive / eager:>10.3f}" if eager else f"{'-':>10}"
    return cells


def _table(e: PhaseResult, a: PhaseResult) -> list[str]:
    from adaptive_eager.device import format_bytes

    t = e.tail
    return [
        f"{'':<30}{'eager':>14}{'adaptive':>14}{'ratio':>10}",
        _row("steps", e.steps, a.steps, "d", ratio=False),
        _row("final loss", e.losses[-1], a.losses[-1], ".6f", ratio=False),
        f"{'losses bit-identical':<30}{str(e.losses == a.losses):>28}",
        f"{'parameters bit-identical':<30}{str(_bit_identical(e.params, a.params)):>28}",
        _row(f"ops/step (last {t})", e.ops_tail / t, a.ops_tail / t, ".1f"),
        _row(f"launches/step (last {t})", e.launches_tail / t, a.launches_tail / t, ".2f"),
        _row("launches/step (overall)", e.launches / e.steps, a.launches / a.steps, ".2f"),
        _row(f"device us/step (last {t})", e.device_us_tail / t, a.device_us_tail / t, ".1f"),
        _row("device us/step (overall)", e.device_us / e.steps, a.device_us / a.steps, ".1f"),
        _row(f"wall ms/step (last {t})", e.wall_s_tail / t * 1e3, a.wall_s_tail / t * 1e3, ".2f"),
        _row("wall ms/step (overall)", e.wall_s / e.steps * 1e3, a.wall_s / a.steps * 1e3, ".2f"),
        _row("peak device memory (bytes)", e.peak_memory_bytes, a.peak_memory_bytes, "d")
        + f"   ({format_bytes(e.peak_memory_bytes)} / {format_bytes(a.peak_memory_bytes)})",
    ]


def cmd_demo(args) -> int:
    import torch

    import adaptive_eager

    if args.quick:
        args.steps = min(args.steps, 10)
    if args.steps < 2:
        print(f"--steps {args.steps}: use at least 2 steps (the engine needs a repeat to fuse).")
        return 2
    if args.plot:
        from .plot import PlotError, require_matplotlib

        try:
            require_matplotlib(args.plot)  # before training, not after it
        except PlotError as e:
            print(f"adaptive-eager demo: {e}", file=sys.stderr)
            return 2
    args.tail = max(1, min(10, args.steps // 2))
    props = torch.neuron.get_device_properties(0)
    print(f"demo: MLP {args.layers} layers of width {args.width}, batch {args.batch}, AdamW, "
          f"cross-entropy, {args.steps} steps, data on the {args.data} (torch {torch.__version__})")
    results = {}
    for mode in _MODES:
        print(f"[{mode}] training {args.steps} steps ...", end=" ", flush=True)
        results[mode] = _train(mode, args)
        print(f"done in {results[mode].wall_s:.2f} s", flush=True)
    eager, adaptive = results["eager"], results["adaptive"]
    print()
    print("\n".join(_table(eager, adaptive)))
    print(f"launch overhead: {props.launch_overhead_us:g} us per launch (modelled; "
          f"NEURON_LAUNCH_OVERHEAD_US); profile {props.profile}")
    print(f"engine: {adaptive_eager.stats().traces} traces cached; adaptive_eager.explain() tells more")
    if args.plot:
        from .plot import write_demo_plot

        write_demo_plot(args.plot, results, args)
        print(f"plot written to {args.plot}")
    if eager.losses != adaptive.losses or not _bit_identical(eager.params, adaptive.params):
        print("error: adaptive mode did not reproduce eager mode bit for bit; this is an engine bug, "
              "please report it with this output (NEURON_ADAPTIVE_EAGER=0 works around it).",
              file=sys.stderr)
        return 1
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive-eager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the emulated devices, profile and settings")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("demo", help="train a small MLP in eager and adaptive mode and compare them")
    p.add_argument("--steps", type=_positive_int, default=30, help="training steps per mode (default 30)")
    p.add_argument("--quick", action="store_true", help="at most 10 steps")
    p.add_argument("--width", type=_positive_int, default=256, help="hidden width (default 256)")
    p.add_argument("--layers", type=_positive_int, default=3, help="linear layers (default 3)")
    p.add_argument("--batch", type=_positive_int, default=64, help="batch size (default 64)")
    p.add_argument("--data", choices=("device", "host"), default="device",
                   help="'device': the batch is moved to neuron once, before the loop (default); "
                        "'host': it is copied to neuron every step (into a new tensor: not a sync point)")
    p.add_argument("--plot", metavar="FILE",
                   help="write a PNG of launches per step and the device time split (needs matplotlib)")
    p.set_defaults(func=cmd_demo)
    from . import run as run_cli

    run_cli.add_parser(sub)
    from . import project as project_cli

    project_cli.add_parser(sub)
    from . import bench as bench_cli

    bench_cli.add_parser(sub)
    return parser


def main(argv=None) -> int:
    from . import run as run_cli

    argv = sys.argv[1:] if argv is None else list(argv)
    args = run_cli.parse_args(build_parser(), argv)  # `run`, `project`: the script's argv goes through verbatim
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
