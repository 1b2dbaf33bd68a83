"""A kernel launched on several ranks at once, as the Neuron runtime runs one compiled kernel
on N logical NeuronCores for collectives (nki.collectives).

Note [Rank launches]: on the chip a kernel that calls nki.collectives is compiled once and run
by the runtime on `collective_ranks` logical NeuronCores, each with its own inputs, its own HBM
tensors and its own rank id (the NKI library's harness: `InferenceArgs(collective_ranks=N)` with
`PerRankLazyInputGenerator(rank -> inputs)`, test/integration/nkilib/experimental/collectives/
test_collectives.py). `run_ranks(kernel, N, inputs)` is that launch: rank r runs the kernel as
an ordinary call (`kernel.run`) on its own copy of its inputs, with its own timeline, and the
ranks meet at collectives in lockstep (Note [Lockstep programs] in lockstep.py), so values and
modelled times never depend on the OS scheduler. It is not `kernel[N]`: a grid's programs share
their inputs and shared_hbm tensors (one logical core's NeuronCores), ranks share nothing.
A rank runs one program: a kernel with a grid (LNC=2 programs inside a rank) is refused for now.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils._pytree as pytree

from .errors import NkiValidationError
from .kernel import Kernel, logical_cores, run
from .lockstep import run_programs
from .target import current_target

# the counts the Neuron runtime accepts for a collective launch: "NRT only supports 1, 2, 4, 8,
# 16 or multiples of 32" (nki-library test/utils/common_dataclasses.py:388)
_RUNTIME_RANKS = (1, 2, 4, 8, 16)


class RankContext:
    """What a program of a rank launch knows of it: the launch's lockstep, its rank, how many,
    and the LNC setting each rank is made of (how many ranks share a chip's NeuronLink)."""

    def __init__(self, lockstep, rank: int, n: int, lnc: int):
        self.lockstep, self.rank, self.n, self.lnc = lockstep, rank, n, lnc


def run_ranks(kernel, collective_ranks: int, inputs, *, target=None):
    """Run `kernel` on ranks 0..collective_ranks-1; ([result per rank], [timeline per rank]).

    `inputs` is the kernel's keyword arguments, the same for every rank (each rank gets its own
    copy of each tensor), or a function rank -> keyword arguments."""
    n = int(collective_ranks)
    if n < 1 or (n not in _RUNTIME_RANKS and n % 32):
        raise NkiValidationError(f"run_ranks: collective_ranks must be 1, 2, 4, 8, 16 or a multiple of 32 (what the "
                                 f"Neuron runtime launches), got {collective_ranks}")
    if not isinstance(kernel, Kernel):
        raise TypeError(f"run_ranks takes an @nki.jit kernel, got {type(kernel).__name__}")
    if kernel.grid and any(g != 1 for g in kernel.grid):
        raise NkiValidationError(f"run_ranks: {kernel!r} has a grid; each rank runs one program here (an LNC=2 grid "
                                 f"inside a rank is not emulated yet): launch the kernel without [..]")
    target = target or current_target()
    lnc = logical_cores()
    per_rank = [_own_copy(inputs(r) if callable(inputs) else inputs, r) for r in range(n)]
    results, timelines = [None] * n, [None] * n

    def body(r: int, lockstep):
        results[r], timelines[r] = run(kernel, (), per_rank[r], target=target, rank=RankContext(lockstep, r, n, lnc))

    run_programs(n, body)
    return results, timelines


def _own_copy(kwargs, rank: int) -> dict:
    """A rank's inputs, copied: ranks have their own HBM, so one rank's writes never reach another's."""
    if not isinstance(kwargs, dict):
        raise TypeError(f"run_ranks: inputs must be a dict of keyword arguments or a function rank -> dict, got "
                        f"{type(kwargs).__name__} for rank {rank}")

    def copy(x):
        if isinstance(x, np.ndarray):
            return x.copy()
        if isinstance(x, torch.Tensor):
            return x.clone()
        return x

    return pytree.tree_map(copy, kwargs)
