"""nki.collectives: communication between the ranks of a collective launch (Note [Rank launches]
in ranks.py), run in lockstep and priced on the NeuronLink and DMA figures of costs.py.

The API and its limits are those of aws-neuron-sdk nki/api/nki/collectives/__init__.py (NKI of
Neuron SDK 2.32/2.33); AWS's own simulator does not implement it (nki/guides/nki_simulator.rst:
"nki.collectives APIs are not implemented in the simulator"). Each call is one collective of
its replica subgroup: the n-th call of a kind by a rank meets the n-th call of that kind by the
other ranks of its subgroup; when the last arrives, the values move (every source read before
any destination is written, so a source may be its own destination) and every rank's timeline
places the collective at the same start (timeline.issue_across).

all_gather_v and all_to_all_v are in collectives_v.py; what every collective shares (sub-groups,
operand checks, the meeting) in collectives_common.py.

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

import torch

from . import dtypes as dt
from . import ops
from .collectives_common import ReplicaGroup, _cost, _meet, _rank_program, _sig, _subgroup, _tensors
from .collectives_v import all_gather_v, all_to_all_v
from .errors import NkiValidationError
from .isa import VirtualRegister
from .operands import close_psum
from .tensor import SBUF, NkiTensor

_REDUCE_OPS = {"add": ops.add, "maximum": ops.maximum, "minimum": ops.minimum}
_MAX_CHANNELS_WHOLE, _MAX_CHANNELS_SUBSET = 4, 2  # collective_permute_implicit's docstring


# --- operands ----------------------------------------------------------------------------------------
def _op(api: str, op):
    name = getattr(op, "name", None)
    if _REDUCE_OPS.get(name) is not op:
        raise NkiValidationError(f"nki.collectives.{api}: op must be nl.add, nl.minimum or nl.maximum, got "
                                 f"{getattr(op, 'name', op)!r}")
    return op


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



__all__ = ["ReplicaGroup", "all_gather", "all_gather_v", "all_reduce", "all_to_all", "all_to_all_v",
           "collective_permute", "collective_permute_implicit", "collective_permute_implicit_current_processing_rank_id",
           "collective_permute_implicit_reduce", "rank_id", "reduce_scatter"]
