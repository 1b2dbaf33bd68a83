"""The `adaptive-eager` command line."""
from __future__ import annotations

import argparse
import sys


def cmd_info(args) -> int:
    import torch

    import adaptive_eager  # noqa: F401  (registers the device)
    from device import format_bytes

    rt = torch.neuron
    props = rt.get_device_properties(0)
    print(f"adaptive-eager {adaptive_eager.__version__}, torch {torch.__version__}")
    print(f"profile: {props.profile}, {rt.device_count()} devices of {props.neuron_cores} NeuronCores")
    for i in range(rt.device_count()):
        p = rt.get_device_properties(i)
        print(f"  neuron:{i}  {p.name}  memory {format_bytes(p.total_memory)}")
    print(f"launch overhead: {props.launch_overhead_us:g} us per launch (modelled; an assumption, "
          f"no official figure is published)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="adaptive-eager", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="print the emulated devices, profile and settings")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
