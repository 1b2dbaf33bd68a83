"""What every nki.collectives call does: find its rank's sub-group, check its tensors, and meet
the other ranks of the sub-group in lockstep (Note [Rank launches] in ranks.py). Shared by
collectives.py and collectives_v.py; the module docstring of collectives.py gives the sources
and the choices (shared_hbm operands, a rank in no sub-group)."""
from __future__ import annotations

import dataclasses

from . import costs
from .errors import NkiValidationError
from .program import current
from .tensor import PSUM, SBUF, SHARED_HBM, NkiTensor
from .timeline import Instr, issue_across


@dataclasses.dataclass
class ReplicaGroup:
    """Groups of ranks that run a collective together: ReplicaGroup([[0, 1], [2, 3]]). The
    sub-groups "should not have any overlap" (the API's docstring); checked at each call."""

    replica_groups: list

    def __post_init__(self):
        try:
            self.replica_groups = [[int(r) for r in g] for g in self.replica_groups]
        except TypeError:
            raise NkiValidationError(f"ReplicaGroup takes a list of rank lists, e.g. ReplicaGroup([[0, 1, 2, 3]]), got "
                                     f"{self.replica_groups!r}") from None


# --- who, and with whom ---------------------------------------------------------------------------
def _rank_program(api: str):
    program = current()
    if program.ranks is None:
        raise NkiValidationError(
            f"nki.collectives.{api} runs between the ranks of a collective launch: run the kernel with "
            f"adaptive_eager.nki.run_ranks(kernel, collective_ranks, inputs), one rank per logical NeuronCore")
    return program


def _subgroup(api: str, replica_group, program) -> tuple[int, ...]:
    """The rank list of `replica_group` holding this rank, after checking the whole group."""
    if not isinstance(replica_group, ReplicaGroup):
        raise NkiValidationError(f"nki.collectives.{api}: replica_group must be a ReplicaGroup([[ranks], ...]), got "
                                 f"{type(replica_group).__name__}")
    n, me, seen = program.ranks.n, program.ranks.rank, {}
    for g in replica_group.replica_groups:
        if not g:
            raise NkiValidationError(f"nki.collectives.{api}: replica group {replica_group.replica_groups} has an "
                                     f"empty rank list; give every sub-group at least one rank")
        for r in g:
            if not 0 <= r < n:
                raise NkiValidationError(f"nki.collectives.{api}: rank {r} of replica group "
                                         f"{replica_group.replica_groups} is out of range: the launch has ranks "
                                         f"[0, {n}); use ranks of the launch")
            if r in seen:
                raise NkiValidationError(f"nki.collectives.{api}: rank {r} appears twice in replica group "
                                         f"{replica_group.replica_groups}; sub-groups must not overlap")
            seen[r] = tuple(g)
    if me not in seen:
        raise NkiValidationError(f"nki.collectives.{api}: rank {me} is in no sub-group of replica group "
                                 f"{replica_group.replica_groups}; every rank that calls it must be in one")
    return seen[me]


def _tensors(api: str, srcs, dsts, *, sbuf: bool = True, many: bool = True, channels: bool = False
             ) -> tuple[list, list, str]:
    """The source and destination lists, checked: one memory for all (HBM or SBUF), several
    tensors only in HBM (`channels`: one per channel, not coalesced, so any number). Returns
    (srcs, dsts, buffer)."""
    srcs, dsts = list(srcs), list(dsts)
    if not srcs or len(srcs) != len(dsts):
        raise NkiValidationError(f"nki.collectives.{api}: srcs and dsts must be lists of one length >= 1, got "
                                 f"{len(srcs)} and {len(dsts)}")
    for t in srcs + dsts:
        if not isinstance(t, NkiTensor):
            raise NkiValidationError(f"nki.collectives.{api}: srcs and dsts hold NKI tensors, got {type(t).__name__}")
        if t.buffer == PSUM:
            raise NkiValidationError(f"nki.collectives.{api}: {t.describe()} is in PSUM; collectives read and write "
                                     f"HBM or SBUF: copy it to SBUF first")
        if t.on_chip and not sbuf:
            raise NkiValidationError(f"nki.collectives.{api}: {t.describe()} is in SBUF, and {api} supports HBM "
                                     f"tensors only: dma_copy it into an nl.ndarray(..., buffer=nl.shared_hbm)")
        if not t.on_chip and (t.buffer != SHARED_HBM or t.storage.serial in current().launch.arguments):
            raise NkiValidationError(
                f"nki.collectives.{api}: {t.describe()} is a kernel argument or private HBM; collectives cannot "
                f"read or write the kernel's IO tensors: dma_copy it into an nl.ndarray(..., buffer=nl.shared_hbm) "
                f"the kernel allocates and pass that")
    kinds = {t.on_chip for t in srcs + dsts}
    if len(kinds) > 1:
        raise NkiValidationError(f"nki.collectives.{api}: the tensors mix HBM and SBUF "
                                 f"({', '.join(t.describe() for t in srcs + dsts)}); all must be in HBM or all in "
                                 f"SBUF: dma_copy the odd ones over")
    on_chip = kinds.pop()
    if len(srcs) > 1 and not channels and (on_chip or not many):
        where = "SBUF tensors" if on_chip else f"{api}"
        raise NkiValidationError(f"nki.collectives.{api}: several tensors in one call (coalesced) are supported only "
                                 f"for HBM tensors, and not by collective_permute(_implicit); {where} take one: got "
                                 f"{len(srcs)}; make one call per tensor")
    return srcs, dsts, (SBUF if on_chip else SHARED_HBM)


# --- the meeting ----------------------------------------------------------------------------------
def _meet(api: str, program, group: tuple[int, ...], payload: dict, exchange, cost, sig) -> None:
    """Arrive at this rank's next `api` collective of `group` with its tensors, its own price (a
    costs.Cost, or a function of the arrivals returning one, called after exchange) and `sig`
    (what every rank must agree on: shapes, dtypes, op, dim); the last to arrive checks the ranks
    agree, runs exchange({rank: payload}) and places the collective on every rank's timeline."""
    n = program.collectives.get((api, group), 0)
    program.collectives[(api, group)] = n + 1
    payload = dict(payload, program=program, cost=cost, sig=sig)

    # runs in the last arriving rank's thread, with every rank of the group parked (lockstep.py)
    def complete(arrived: dict) -> None:
        first = group[0]
        for r in group:
            if arrived[r]["sig"] != arrived[first]["sig"]:
                raise NkiValidationError(f"nki.collectives.{api} #{n + 1} of ranks {list(group)}: rank {first} calls it "
                                         f"with {arrived[first]['sig']}, rank {r} with {arrived[r]['sig']}; every rank "
                                         f"must pass the same shapes, dtypes and options")
        exchange(arrived)
        # a callable price is one known only now, from the metadata of every rank (the _v collectives)
        entries = [(p["program"].launch.timeline, p["program"],
                    Instr(api, costs.DMA, p["cost"](arrived) if callable(p["cost"]) else p["cost"], list(p["srcs"]),
                          list(p["dsts"]))) for p in arrived.values()]
        issue_across(entries)

    ctx = program.ranks
    core = f" core {ctx.program}" if ctx.programs > 1 else ""
    key = (f"nki.collectives.{api} of ranks {list(group)}{core}", None, n)
    # launch-wide indices: program p of each rank of the group (Note [Rank launches])
    ctx.lockstep.meet(ctx.index(ctx.rank), key, tuple(ctx.index(r) for r in group), payload,
                      lambda arrived: complete({i // ctx.programs: v for i, v in arrived.items()}))


def _sig(*parts, tensors=()) -> tuple:
    return parts + tuple((tuple(t.shape), t.dtype.name if hasattr(t.dtype, "name") else str(t.dtype)) for t in tensors)


def _cost(program, wire_bytes: float, hops: int, reduce_bytes: float = 0.0) -> costs.Cost:
    return costs.collective(program.target, program.ranks.lnc, wire_bytes, hops, reduce_bytes)
