"""The `adaptive-eager` command line (and `python -m adaptive_eager`): one module per command.

- `main.py`: the parser, `info`, and `demo` (the same MLP trained in eager and adaptive mode);
- `run.py`: `adaptive-eager run script.py`, a user's unchanged script and a report of the device;
- `bench.py`: `adaptive-eager bench`, the comparison suite of bench/ as one table of ratios;
- `plot.py`: the pictures of `--plot` (matplotlib, an optional extra);
- `ddp_demo.py`: `torchrun -m adaptive_eager.cli.ddp_demo`, the demo under DDP.

A new command is a module here with an `add_parser(sub)`, added to `main.build_parser`.
"""
from .main import main

__all__ = ["main"]
