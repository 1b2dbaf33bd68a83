"""nki.collectives: communication between the ranks of a collective launch (Note [Rank launches]
in ranks.py), run in lockstep and priced on the NeuronLink and DMA figures of costs.py.

The API and its limits are those of aws-neuron-sdk nki/api/nki/collectives/__init__.py (NKI of
Neuron SDK 2.32/2.33); AWS's own simulator does not implement it (nki/guides/nki_simulator.rst:
"nki.collectives APIs are not implemented in the simulator"). Each call is one collective of
its replica subgroup: the n-th call of a kind by a rank meets the n-th call of that kind by the
other ranks of its subgroup; when the last arrives, the values move (every source read before
any destination is written, so a source may be its own destination) and every rank's timeline
places the collective at the same start (timeline.issue_across).

Where the docs are silent, this module chooses, and says so at the line:
- reductions accumulate in float32, in the order of the subgroup's rank list, and round once
  into each destination: the compiler's reference says all-reduce and reduce-scatter "have no
  integer datapath at all - they compute in floating point, so both int32 and int64 operands
  are downcast to FP32" (compiler/neuronx-cc/api-reference-guide/index.rst:136);
- HBM operands must be nl.shared_hbm tensors the kernel allocated, not its arguments: the NKI
  library's kernels copy arguments first, "Collective instruction cannot read/write IO tensors"
  and "all_gather requires src in shared_hbm" (nki-library test_collectives.py);
- a rank in no subgroup of the replica group cannot call a collective of it.
"""
from __future__ import annotations

import dataclasses

import torch

from . import costs
from . import dtypes as dt
from . import ops
from .errors import NkiValidationError
from .isa import VirtualRegister
from .operands import close_psum
from .program import current
from .tensor import PSUM, SBUF, SHARED_HBM, NkiTensor
from .timeline import Instr, issue_across

_REDUCE_OPS = {"add": ops.add, "maximum": ops.maximum, "minimum": ops.minimum}
_MAX_CHANNELS_WHOLE, _MAX_CHANNELS_SUBSET = 4, 2  # collective_permute_implicit's docstring


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


# --- who, and with whom --------------------------------------------------------------------------
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


def _op(api: str, op):
    name = getattr(op, "name", None)
    if _REDUCE_OPS.get(name) is not op:
        raise NkiValidationError(f"nki.collectives.{api}: op must be nl.add, nl.minimum or nl.maximum, got "
                                 f"{getattr(op, 'name', op)!r}")
    return op


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


def _read(t: NkiTensor) -> torch.Tensor:
    """A tensor's values, float32 for floats (as the collective's datapath sees them)."""
    return dt.decode(t.torch_view(), t.dtype).to(torch.float32).reshape(t.shape)


def _write(t: NkiTensor, values: torch.Tensor) -> None:
    t.torch_view().copy_(dt.encode(values.reshape(t.shape), t.dtype).reshape(t.shape))
    close_psum(t)


def _reduce(op, values: list[torch.Tensor]) -> torch.Tensor:
    """float32, in the subgroup's rank order (the module docstring's choice)."""
    acc = values[0].to(torch.float32)
    for v in values[1:]:
        acc = op.fn(acc, v.to(torch.float32))
    return acc


def _nbytes(ts) -> int:
    return sum(t.size * t.dtype.itemsize for t in ts)


# --- the meeting ----------------------------------------------------------------------------------
def _meet(api: str, program, group: tuple[int, ...], payload: dict, exchange, cost, sig) -> None:
    """Arrive at this rank's next `api` collective of `group` with its tensors, its own price
    (a costs.Cost, or a function of the arrivals returning one, called after exchange) and `sig` (what every rank must agree on: shapes, dtypes, op, dim); the last to arrive
    checks the ranks agree, runs exchange({rank: payload}) and places the collective on every
    rank's timeline."""
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


def _same_shapes(api: str, what: str, a: NkiTensor, b: NkiTensor, want) -> None:
    if tuple(b.shape) != tuple(want) or a.dtype != b.dtype:
        raise NkiValidationError(f"nki.collectives.{api}: {what} must be {tuple(want)} {a.dtype} for "
                                 f"{a.describe()}, got {b.describe()}")


def _collective_dim(api: str, dim, buffer: str, allowed_sbuf=(0,)) -> int:
    dim = int(dim)
    allowed = allowed_sbuf if buffer == SBUF else (0,)
    if dim not in allowed:
        raise NkiValidationError(f"nki.collectives.{api}: collective_dim {dim} is not supported for "
                                 f"{'SBUF' if buffer == SBUF else 'HBM'} tensors; use one of {list(allowed)}")
    return dim


# --- the collectives ------------------------------------------------------------------------------
def all_reduce(srcs, dsts, replica_group, op, priority=None, name=None) -> None:
    """Every rank of the subgroup gets op over the subgroup's srcs, in each dst."""
    program = _rank_program("all_reduce")
    group = _subgroup("all_reduce", replica_group, program)
    op = _op("all_reduce", op)
    srcs, dsts, _ = _tensors("all_reduce", srcs, dsts)
    for s, d in zip(srcs, dsts):
        _same_shapes("all_reduce", "each dst", s, d, s.shape)

    def exchange(arrived):
        per_rank = [[_read(s) for s in arrived[r]["srcs"]] for r in group]
        for i in range(len(srcs)):
            total = _reduce(op, [values[i] for values in per_rank])
            for r in group:
                _write(arrived[r]["dsts"][i], total)

    k, nbytes = len(group), _nbytes(srcs)
    # ring all-reduce: reduce-scatter then all-gather, 2(k-1) hops, 2(k-1)/k of the bytes sent
    _meet("all_reduce", program, group, {"srcs": srcs, "dsts": dsts}, exchange,
          _cost(program, 2 * (k - 1) / k * nbytes, 2 * (k - 1), (k - 1) / k * nbytes), _sig(op.name, tensors=srcs))


def all_gather(srcs, dsts, replica_group, collective_dim, priority=None, name=None) -> None:
    """Every rank of the subgroup gets the subgroup's srcs concatenated along collective_dim,
    in rank-list order."""
    program = _rank_program("all_gather")
    group = _subgroup("all_gather", replica_group, program)
    srcs, dsts, buffer = _tensors("all_gather", srcs, dsts)
    # "For SBUF tensors, 0 or 1 is supported as SBUF collectives currently only operate on 2D tensors"
    dim = _collective_dim("all_gather", collective_dim, buffer, allowed_sbuf=(0, 1))
    k = len(group)
    for s, d in zip(srcs, dsts):
        if buffer == SBUF and len(s.shape) != 2:
            raise NkiValidationError(f"nki.collectives.all_gather: SBUF collectives operate on 2D tiles, got "
                                     f"{s.describe()}")
        want = list(s.shape)
        want[dim] *= k
        _same_shapes("all_gather", "each dst", s, d, want)

    def exchange(arrived):
        for i in range(len(srcs)):
            gathered = torch.cat([_read(arrived[r]["srcs"][i]) for r in group], dim=dim)
            for r in group:
                _write(arrived[r]["dsts"][i], gathered)

    nbytes = _nbytes(srcs)
    _meet("all_gather", program, group, {"srcs": srcs, "dsts": dsts}, exchange,
          _cost(program, (k - 1) * nbytes, k - 1), _sig(dim, tensors=srcs))


def reduce_scatter(srcs, dsts, replica_group, collective_dim, op, priority=None, name=None) -> None:
    """op over the subgroup's srcs, split along dim 0 into one chunk per rank: the rank at
    position i of the rank list gets chunk i."""
    program = _rank_program("reduce_scatter")
    group = _subgroup("reduce_scatter", replica_group, program)
    op = _op("reduce_scatter", op)
    srcs, dsts, buffer = _tensors("reduce_scatter", srcs, dsts)
    dim = _collective_dim("reduce_scatter", collective_dim, buffer)
    k = len(group)
    for s in srcs:
        if s.shape[dim] % k:
            raise NkiValidationError(f"nki.collectives.reduce_scatter: dim {dim} of {s.describe()} must divide by the "
                                     f"sub-group's {k} ranks")
    for s, d in zip(srcs, dsts):
        want = list(s.shape)
        want[dim] //= k
        _same_shapes("reduce_scatter", "each dst", s, d, want)

    def exchange(arrived):
        for i in range(len(srcs)):
            total = _reduce(op, [_read(arrived[r]["srcs"][i]) for r in group])
            for pos, chunk in enumerate(torch.chunk(total, k, dim=dim)):
                _write(arrived[group[pos]]["dsts"][i], chunk)

    nbytes = _nbytes(srcs)
    _meet("reduce_scatter", program, group, {"srcs": srcs, "dsts": dsts}, exchange,
          _cost(program, (k - 1) / k * nbytes, k - 1, (k - 1) / k * nbytes), _sig(op.name, dim, tensors=srcs))


def all_to_all(srcs, dsts, replica_group, collective_dim, priority=None, name=None) -> None:
    """Each src splits along dim 0 into one chunk per rank; chunk j goes to the rank at position
    j; each dst is the chunks it received, in rank-list order of their senders."""
    program = _rank_program("all_to_all")
    group = _subgroup("all_to_all", replica_group, program)
    srcs, dsts, buffer = _tensors("all_to_all", srcs, dsts, sbuf=False)
    dim = _collective_dim("all_to_all", collective_dim, buffer)
    k = len(group)
    for s, d in zip(srcs, dsts):
        if s.shape[dim] % k:
            raise NkiValidationError(f"nki.collectives.all_to_all: dim {dim} of {s.describe()} must divide by the "
                                     f"sub-group's {k} ranks")
        _same_shapes("all_to_all", "each dst", s, d, s.shape)

    def exchange(arrived):
        for i in range(len(srcs)):
            chunks = {r: torch.chunk(_read(arrived[r]["srcs"][i]), k, dim=dim) for r in group}
            for pos, r in enumerate(group):
                _write(arrived[r]["dsts"][i], torch.cat([chunks[sender][pos] for sender in group], dim=dim))

    nbytes = _nbytes(srcs)
    # one step: the Mesh algorithm "directly broadcasts/scatters data to all other ranks in one step"
    # (neuron-runtime/explore/intranode-collective-comm.rst:94); the NKI library's test notes
    # "all_to_all requires Mesh algorithm"
    _meet("all_to_all", program, group, {"srcs": srcs, "dsts": dsts}, exchange,
          _cost(program, (k - 1) / k * nbytes, 1), _sig(dim, tensors=srcs))


def collective_permute(srcs, dsts, source_target_pairs, priority=None, name=None) -> None:
    """Each (source, target) pair sends source's src into target's dst. The ranks named by the
    pairs meet (a rank named by none returns at once, its dst untouched)."""
    program = _rank_program("collective_permute")
    srcs, dsts, _ = _tensors("collective_permute", srcs, dsts, sbuf=False, many=False)
    n, me = program.ranks.n, program.ranks.rank
    try:
        pairs = [(int(a), int(b)) for a, b in source_target_pairs]
    except (TypeError, ValueError):
        raise NkiValidationError(f"nki.collectives.collective_permute: source_target_pairs must be (source, target) "
                                 f"rank pairs, got {source_target_pairs!r}") from None
    targets = [b for _, b in pairs]
    for a, b in pairs:
        if not (0 <= a < n and 0 <= b < n):
            raise NkiValidationError(f"nki.collectives.collective_permute: pair ({a}, {b}) names a rank outside the "
                                     f"launch's [0, {n})")
    dup = sorted({b for b in targets if targets.count(b) > 1})
    if dup:
        raise NkiValidationError(f"nki.collectives.collective_permute: rank(s) {dup} receive from several sources in "
                                 f"{pairs}; each rank has one dst: give each target one source")
    group = tuple(sorted({r for pair in pairs for r in pair} | {me}))

    def exchange(arrived):
        values = {a: _read(arrived[a]["srcs"][0]) for a, _ in pairs}  # every source first
        for a, b in pairs:
            _same_shapes("collective_permute", f"rank {b}'s dst", arrived[a]["srcs"][0], arrived[b]["dsts"][0],
                         arrived[a]["srcs"][0].shape)
            _write(arrived[b]["dsts"][0], values[a])

    sends = sum(1 for a, _ in pairs if a == me)
    nbytes = _nbytes(srcs)
    _meet("collective_permute", program, group, {"srcs": srcs, "dsts": dsts}, exchange,
          _cost(program, sends * nbytes, 1 if sends else 0), _sig(tuple(pairs)))


def _channels(api: str, program, group, by_channel: dict, channel_ids) -> tuple[list, list[list], str]:
    """Checks the per-channel lists (one tensor each, channels 0..C-1, at most 4 for a group of
    every rank of the launch, else 2: the API's docstring); returns (ids, lists, buffer)."""
    lists = {k: [list(c) for c in v] for k, v in by_channel.items()}
    lengths = {len(v) for v in lists.values()}
    channel_ids = [int(c) for c in channel_ids]
    if len(lengths) != 1 or lengths.pop() != len(channel_ids):
        raise NkiValidationError(f"nki.collectives.{api}: {', '.join(lists)} and channel_ids must have one length "
                                 f"(one entry per channel), got {[len(v) for v in lists.values()]} and "
                                 f"{len(channel_ids)}")
    if channel_ids != list(range(len(channel_ids))):
        raise NkiValidationError(f"nki.collectives.{api}: channel_ids must be consecutive from 0, got {channel_ids}")
    whole = len(group) == program.ranks.n
    most = _MAX_CHANNELS_WHOLE if whole else _MAX_CHANNELS_SUBSET
    if len(channel_ids) > most:
        raise NkiValidationError(f"nki.collectives.{api}: {len(channel_ids)} channels; at most {most} for "
                                 f"{'a group of every rank' if whole else 'a sub-group'} of the launch")
    flat = []
    for k, v in lists.items():
        for c, tensors in enumerate(v):
            if len(tensors) != 1:
                raise NkiValidationError(f"nki.collectives.{api}: {k}[{c}] holds {len(tensors)} tensors; each channel "
                                         f"takes exactly one (coalesced permutes are not supported)")
            flat.append(tensors[0])
    _, _, buffer = _tensors(api, flat, flat, channels=True)
    return channel_ids, list(lists.values()), buffer


def _ring(group, me) -> tuple[int, int]:
    pos = group.index(me)
    return group[(pos + 1) % len(group)], group[(pos - 1) % len(group)]


def collective_permute_implicit(srcs_by_channel, dsts_by_channel, replica_group, channel_ids=(0,), priority=None,
                                name=None) -> None:
    """One step of a ring: on each channel, send src to the successor in the rank list and
    receive the predecessor's into dst. A ring all-gather is k-1 such calls."""
    program = _rank_program("collective_permute_implicit")
    group = _subgroup("collective_permute_implicit", replica_group, program)
    ids, (srcs, dsts), _ = _channels("collective_permute_implicit", program, group,
                                     {"srcs_by_channel": srcs_by_channel, "dsts_by_channel": dsts_by_channel},
                                     channel_ids)
    srcs, dsts = [c[0] for c in srcs], [c[0] for c in dsts]
    for s, d in zip(srcs, dsts):
        _same_shapes("collective_permute_implicit", "each dst", s, d, s.shape)

    def exchange(arrived):
        values = {r: [_read(s) for s in arrived[r]["srcs"]] for r in group}
        for r in group:
            _, pred = _ring(group, r)
            for c in ids:
                _write(arrived[r]["dsts"][c], values[pred][c])

    nbytes = _nbytes(srcs) if len(group) > 1 else 0
    _meet("collective_permute_implicit", program, group, {"srcs": srcs, "dsts": dsts}, exchange,
          _cost(program, nbytes, 1 if nbytes else 0), _sig(tuple(ids), tensors=srcs))


def collective_permute_implicit_reduce(srcs0_by_channel, srcs1_by_channel, dsts_by_channel, replica_group, op,
                                       channel_ids=(0,), priority=None, name=None) -> None:
    """One step of a reducing ring: on each channel, send op(srcs0, srcs1) (float32, rounded
    once into the receiver's dst) to the successor; receive the predecessor's into dst."""
    api = "collective_permute_implicit_reduce"
    program = _rank_program(api)
    group = _subgroup(api, replica_group, program)
    op = _op(api, op)
    ids, (srcs0, srcs1, dsts), _ = _channels(api, program, group, {
        "srcs0_by_channel": srcs0_by_channel, "srcs1_by_channel": srcs1_by_channel,
        "dsts_by_channel": dsts_by_channel}, channel_ids)
    srcs0, srcs1, dsts = [c[0] for c in srcs0], [c[0] for c in srcs1], [c[0] for c in dsts]
    for a, b, d in zip(srcs0, srcs1, dsts):
        _same_shapes(api, "srcs1", a, b, a.shape)
        _same_shapes(api, "each dst", a, d, a.shape)

    def exchange(arrived):
        sums = {r: [_reduce(op, [_read(a), _read(b)]) for a, b in zip(arrived[r]["srcs"][:len(ids)],
                                                                        arrived[r]["srcs"][len(ids):])]
                for r in group}
        for r in group:
            _, pred = _ring(group, r)
            for c in ids:
                _write(arrived[r]["dsts"][c], sums[pred][c])

    nbytes = _nbytes(srcs0)
    _meet(api, program, group, {"srcs": srcs0 + srcs1, "dsts": dsts}, exchange,
          _cost(program, nbytes if len(group) > 1 else 0, 1 if len(group) > 1 else 0, 2 * nbytes),
          _sig(op.name, tuple(ids), tensors=srcs0))


def collective_permute_implicit_current_processing_rank_id(iteration_id, replica_group, channel_id=0, name=None):
    """The rank whose data a ring step `iteration_id` processes: this rank's own at 0, then
    its predecessor's, and so on around the rank list. A register, as on the chip."""
    api = "collective_permute_implicit_current_processing_rank_id"
    program = _rank_program(api)
    group = _subgroup(api, replica_group, program)
    it = int(iteration_id.value if isinstance(iteration_id, VirtualRegister) else iteration_id)
    if it < 0:
        raise NkiValidationError(f"nki.collectives.{api}: iteration_id must be >= 0, got {it}")
    pos = group.index(program.ranks.rank)
    return VirtualRegister(group[(pos - it) % len(group)])


def rank_id(name=None):
    """This rank's id in the launch (0..collective_ranks-1), in a register."""
    program = _rank_program("rank_id")
    return VirtualRegister(program.ranks.rank)


# all_gather_v and all_to_all_v: collectives_v.py, which builds on the helpers above (imported
# last so that module finds them defined)
from .collectives_v import all_gather_v, all_to_all_v  # noqa: E402

__all__ = ["ReplicaGroup", "all_gather", "all_gather_v", "all_reduce", "all_to_all", "all_to_all_v",
           "collective_permute", "collective_permute_implicit", "collective_permute_implicit_current_processing_rank_id",
           "collective_permute_implicit_reduce", "rank_id", "reduce_scatter"]
