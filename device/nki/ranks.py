"""A kernel launched on several ranks at once, as the Neuron runtime runs one compiled kernel
on N logical NeuronCores for collectives (nki.collectives).

Note [Rank launches]: on the chip a kernel that calls nki.collectives is compiled once and run
by the runtime on `collective_ranks` logical NeuronCores, each with its own inputs, its own HBM
tensors and its own rank id (the NKI library's harness: `InferenceArgs(collective_ranks=N)` with
`PerRankLazyInputGenerator(rank -> inputs)`, test/integration/nkilib/experimental/collectives/
test_collectives.py). `run_ranks(kernel, N, inputs)` is that launch: rank r is an ordinary call
of the kernel (kernel.Call) on its own copy of its inputs, with its own timeline; a kernel with
a grid (`kernel[2]`, LNC=2) runs its grid inside every rank, as the library's harness launches
"with LNC grid [lnc]". All programs of all ranks run in one lockstep (Note [Lockstep programs]
in lockstep.py), so values and modelled times never depend on the OS scheduler: program p of
rank r is program r * P + p of the launch; a rank's core_barrier and sendrecv meet its own
programs (lockstep.RankView), and a collective's call by program p of a rank meets the calls by
program p of the other ranks of its group (one per NeuronCore, as each core issues its own).
It is not `kernel[N]`: a grid's programs share their inputs and shared_hbm tensors (one logical
core's NeuronCores), ranks share nothing.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.utils._pytree as pytree

from .errors import NkiValidationError
from .kernel import Call, Kernel, logical_cores
from .lockstep import RankView, run_programs
from .target import current_target

# the counts the Neuron runtime accepts for a collective launch: "NRT only supports 1, 2, 4, 8,
# 16 or multiples of 32" (nki-library test/utils/common_dataclasses.py:388)
_RUNTIME_RANKS = (1, 2, 4, 8, 16)


class RankContext:
    """What a program of a rank launch knows of it: the launch-wide lockstep, its rank and how
    many, its program index in the rank and how many per rank, and the LNC setting each rank is
    made of (how many ranks share a chip's NeuronLink)."""

    def __init__(self, lockstep, rank: int, n: int, program: int, programs: int, lnc: int):
        self.lockstep, self.rank, self.n, self.lnc = lockstep, rank, n, lnc
        self.program, self.programs = program, programs

    def index(self, rank: int) -> int:
        """The launch-wide index of this program's counterpart in `rank`."""
        return rank * self.programs + self.program


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
    target = target or current_target()
    lnc = logical_cores()
    calls = [Call(kernel, (), _own_copy(inputs(r) if callable(inputs) else inputs, r), target=target)
             for r in range(n)]
    per_rank = calls[0].programs

    def body(i: int, lockstep):
        r, p = divmod(i, per_rank)
        view = RankView(lockstep, r * per_rank, per_rank, r) if per_rank > 1 else None
        calls[r].body(p, view, RankContext(lockstep, r, n, p, per_rank, lnc))

    run_programs(n * per_rank, body)
    finished = [call.finish() for call in calls]
    return [f[0] for f in finished], [f[1] for f in finished]


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
