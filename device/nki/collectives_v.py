"""nki.collectives.all_gather_v and all_to_all_v: variable-length collectives over flat element
buffers, whose counts and displacements live in a uint32 metadata tensor read when the
collective runs (not when the kernel is traced). They meet, check and price as the other
collectives of collectives.py do.

Semantics and limits: the docstrings of all_gather_v and all_to_all_v in aws-neuron-sdk
nki/api/nki/collectives/__init__.py. Metadata rows, `rows` x rank_list_size (HBM) or
1 x rows x rank_list_size (SBUF, one partition): 0 send_count(s), 1 send_displ(s), 2 recv_counts
(an output unless recv_counts_known; "never read as input"), 3 recv_displs (only with
has_rdispls). all_gather_v reads only column 0 of rows 0/1: one chunk broadcast to every rank.

Where the docs are silent, this module chooses:
- column c of the metadata, and slot c of a dst, belong to the rank at position c of the rank
  list (the docs write `dst.total_elements / rank_list_size * r`; a rank id past the list's
  size would address past dst, so r is read as a position);
- all_to_all_v sends a rank's own column to itself, as all_to_all keeps its own chunk;
- dst elements no chunk lands on keep their values;
- src and dst have one dtype and elements move unconverted (no reduction, so no float32: an
  int32 payload such as token ids stays exact);
- without recv_displs, dst's element count must divide by the rank list's size;
- with recv_displs, received chunks must not overlap (which write lands last is unspecified);
- ranks are numbered device by device, CORES_PER_CHIP // LNC ranks per device (the figure
  costs.collective_link_bytes_per_ns uses), and run_ranks is one instance: all_to_all_v on
  trn1/trn2, which supports only inter-node groups there, is refused, naming trn3;
- the price: all_gather_v as all_gather's ring (k-1 hops, every other rank's chunk forwarded
  once), all_to_all_v as all_to_all's one-step mesh (the bytes a rank sends to the others),
  from the counts the metadata holds when the collective runs.
"""
from __future__ import annotations

import torch

from . import costs
from . import dtypes as dt
from .collectives_common import _cost, _meet, _rank_program, _sig, _subgroup, _tensors
from .errors import NkiValidationError
from .tensor import NkiTensor

_SEND_COUNT, _SEND_DISPL, _RECV_COUNT, _RECV_DISPL = range(4)


# --- checks at the call -----------------------------------------------------------------------------
def _one_each(api: str, srcs, dsts) -> tuple[NkiTensor, NkiTensor]:
    srcs, dsts = list(srcs), list(dsts)
    if len(srcs) != 1 or len(dsts) != 1:
        raise NkiValidationError(f"nki.collectives.{api}: srcs and dsts take exactly one tensor each (the API's "
                                 f"current limit), got {len(srcs)} and {len(dsts)}; make one call per tensor")
    (src,), (dst,), _ = _tensors(api, srcs, dsts, sbuf=False)
    if src.dtype != dst.dtype:
        raise NkiValidationError(f"nki.collectives.{api}: src and dst must have one dtype (elements move as they are), "
                                 f"got {src.describe()} and {dst.describe()}; copy one to the other's dtype first")
    return src, dst


def _metadata(api: str, meta, k: int, has_rdispls: bool) -> NkiTensor:
    if not isinstance(meta, NkiTensor) or meta.dtype != dt.uint32:
        what = meta.describe() if isinstance(meta, NkiTensor) else type(meta).__name__
        raise NkiValidationError(f"nki.collectives.{api}: metadata_tensor must be a uint32 NKI tensor, got {what}")
    _tensors(api, [meta], [meta])  # HBM the kernel allocated, or SBUF: the collective writes row 2
    rows = (4,) if has_rdispls else (3, 4)  # "row 3 may be omitted" without recv_displs
    want = [(1, r, k) if meta.on_chip else (r, k) for r in rows]
    if tuple(meta.shape) not in want:
        why = "4 rows, as has_rdispls=True reads row 3" if has_rdispls else "3 rows (or 4)"
        raise NkiValidationError(f"nki.collectives.{api}: metadata_tensor must be {want[0]} uint32 in "
                                 f"{'SBUF' if meta.on_chip else 'HBM'} ({why}, one column per rank of the "
                                 f"{k}-rank list), got {meta.describe()}")
    return meta


def _ranks_per_device(program) -> int:
    return max(1, costs.CORES_PER_CHIP[program.target.version] // max(1, program.ranks.lnc))


def _lnc2(api: str, program) -> None:
    if program.ranks.lnc != 2:
        raise NkiValidationError(f"nki.collectives.{api}: only LNC=2 is supported, the launch runs at "
                                 f"LNC={program.ranks.lnc}; set NEURON_LOGICAL_NC_CONFIG=2")


def _all_gather_v_group(program, group) -> None:
    """The API's limits: "Only LNC=2 is supported. Each rank-list must have exactly 4 ranks (intra-chip)"."""
    _lnc2("all_gather_v", program)
    per = _ranks_per_device(program)
    if len(group) != 4 or len({r // per for r in group}) != 1:
        raise NkiValidationError(
            f"nki.collectives.all_gather_v: each rank list must be exactly 4 ranks of one chip (intra-chip), got "
            f"{list(group)}; on {program.target.name} at LNC=2 a chip holds {per} rank(s), numbered consecutively "
            f"from a multiple of {per}")


def _all_to_all_v_group(program, group) -> None:
    """On a NeuronSwitch fabric (trn3): LNC=2, more than one device, every rank of each device
    a rank list touches, sequential ranks. Elsewhere: inter-node groups only."""
    api = "all_to_all_v"
    if program.target.name != "trn3":
        raise NkiValidationError(
            f"nki.collectives.{api}: on {program.target.name} it supports only inter-node replica groups "
            f"(same-indexed ranks of different instances), and run_ranks emulates the ranks of one instance; "
            f"run it for trn3 (NEURON_PLATFORM_TARGET_OVERRIDE=trn3), whose NeuronSwitch fabric takes groups of "
            f"whole devices")
    _lnc2(api, program)
    per = _ranks_per_device(program)
    devices = sorted({r // per for r in group})
    whole = set(range(devices[0] * per, (devices[-1] + 1) * per))
    if len(devices) < 2 or set(group) != whole:
        raise NkiValidationError(
            f"nki.collectives.{api}: on trn3 each rank list must hold every rank of each device it touches "
            f"({per} per device at LNC=2), sequential ranks, on more than one device; got {list(group)}. Use "
            f"e.g. {list(range(2 * per))}; to leave a rank out, keep it in the list with send_count 0")


# --- flat buffers and metadata, when the collective runs -------------------------------------------
def _flat(t: NkiTensor) -> torch.Tensor:
    """A copy of t's stored elements in row-major order (read before anything is written)."""
    return t.torch_view().reshape(-1).clone()


def _store_flat(t: NkiTensor, flat: torch.Tensor) -> None:
    t.torch_view().copy_(flat.reshape(t.shape))


def _read_metadata(meta: NkiTensor) -> torch.Tensor:
    return dt.decode(meta.torch_view(), meta.dtype).to(torch.int64).reshape(meta.shape[-2], meta.shape[-1])


def _write_recv_counts(meta: NkiTensor, values: torch.Tensor, counts: list[int]) -> None:
    values = values.clone()
    values[_RECV_COUNT] = torch.tensor(counts, dtype=torch.int64)
    meta.torch_view().copy_(dt.encode(values.reshape(meta.shape), meta.dtype))


def _chunk(api: str, who: str, flat: torch.Tensor, displ: int, count: int) -> torch.Tensor:
    if displ + count > flat.numel():
        raise NkiValidationError(f"nki.collectives.{api}: {who}'s metadata asks for src[{displ}:{displ + count}], past "
                                 f"its {flat.numel()} elements; fix send_count/send_displ")
    return flat[displ:displ + count]


def _slot(api: str, r: int, dst: NkiTensor, k: int) -> int:
    if dst.size % k:
        raise NkiValidationError(f"nki.collectives.{api}: rank {r}'s dst has {dst.size} elements, which do not divide "
                                 f"into {k} equal slots (one per rank, as without recv_displs); size dst to a "
                                 f"multiple of {k}")
    return dst.size // k


def _place(api: str, r: int, flat: torch.Tensor, chunks: list[tuple[int, torch.Tensor]], slot: int | None) -> None:
    """Writes each sender's (offset, values), in rank-list order, into rank r's flat dst;
    `slot` (no recv_displs) bounds each chunk's size."""
    spans = []
    for s_pos, (at, values) in enumerate(chunks):
        n = values.numel()
        if slot is not None and n > slot:
            raise NkiValidationError(f"nki.collectives.{api}: the rank at position {s_pos} sends {n} elements to rank "
                                     f"{r}, more than its slot of {slot} (dst's size / rank list size); make dst "
                                     f"larger or send fewer")
        if at + n > flat.numel():
            raise NkiValidationError(f"nki.collectives.{api}: the chunk from position {s_pos} would land at "
                                     f"dst[{at}:{at + n}] of rank {r}, past its {flat.numel()} elements; fix "
                                     f"recv_displs")
        if n:
            spans.append((at, at + n, s_pos))
        flat[at:at + n] = values
    spans.sort()
    for (a0, a1, p), (b0, _, q) in zip(spans, spans[1:]):
        if b0 < a1:  # on the chip the order of the two writes is unspecified
            raise NkiValidationError(f"nki.collectives.{api}: in rank {r}'s dst the chunks from positions {p} and {q} "
                                     f"overlap at [{b0}:{a1}); give recv_displs disjoint ranges")


# --- the collectives ------------------------------------------------------------------------------
def all_gather_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None) -> None:
    """Each rank of the subgroup broadcasts src[send_displ : send_displ + send_count] (column 0
    of metadata rows 1 and 0); the chunk of the rank at position s lands in every rank's dst at
    s * dst.size / k. Row 2 gets the counts received unless recv_counts_known."""
    api = "all_gather_v"
    program = _rank_program(api)
    group = _subgroup(api, replica_group, program)
    src, dst = _one_each(api, srcs, dsts)
    k, me = len(group), program.ranks.rank
    _all_gather_v_group(program, group)
    if has_rdispls:
        raise NkiValidationError(f"nki.collectives.{api}: has_rdispls=True is not supported (the API's current "
                                 f"limit); pass has_rdispls=False: the chunk of position s lands at s * dst.size / {k}")
    meta = _metadata(api, metadata_tensor, k, False)
    itemsize = src.dtype.itemsize

    def exchange(arrived):
        metas = {r: _read_metadata(arrived[r]["meta"]) for r in group}
        chunks = [_chunk(api, f"rank {s}", _flat(arrived[s]["srcs"][0]), int(metas[s][_SEND_DISPL, 0]),
                         int(metas[s][_SEND_COUNT, 0])) for s in group]
        for r in group:
            out = arrived[r]["dsts"][0]
            slot = _slot(api, r, out, k)
            flat = _flat(out)
            _place(api, r, flat, [(pos * slot, c) for pos, c in enumerate(chunks)], slot)
            _store_flat(out, flat)
            if not arrived[r]["recv_counts_known"]:
                _write_recv_counts(arrived[r]["meta"], metas[r], [c.numel() for c in chunks])
        total = sum(c.numel() for c in chunks)
        for pos, r in enumerate(group):
            arrived[r]["wire_bytes"] = (total - chunks[pos].numel()) * itemsize

    payload = {"srcs": [src], "dsts": [dst], "meta": meta, "recv_counts_known": bool(recv_counts_known)}
    _meet(api, program, group, payload,
          exchange, lambda arrived: _cost(program, arrived[me]["wire_bytes"], k - 1),
          _sig(bool(recv_counts_known), str(src.dtype), tensors=[meta]))


def all_to_all_v(srcs, dsts, replica_group, metadata_tensor, recv_counts_known=False, has_rdispls=False,
                 priority=None, name=None) -> None:
    """Each rank sends src[send_displs[j] : send_displs[j] + send_counts[j]] to the rank at
    position j; the chunk from position s lands in dst at recv_displs[s] (has_rdispls) or at
    s * dst.size / k. Row 2 gets the counts received unless recv_counts_known."""
    api = "all_to_all_v"
    program = _rank_program(api)
    group = _subgroup(api, replica_group, program)
    src, dst = _one_each(api, srcs, dsts)
    k, me, rdispls = len(group), program.ranks.rank, bool(has_rdispls)
    _all_to_all_v_group(program, group)
    meta = _metadata(api, metadata_tensor, k, rdispls)
    itemsize = src.dtype.itemsize

    def exchange(arrived):
        metas = {r: _read_metadata(arrived[r]["meta"]) for r in group}
        sends = {}
        for s in group:
            flat = _flat(arrived[s]["srcs"][0])
            for j_pos, j in enumerate(group):
                sends[s, j] = _chunk(api, f"rank {s} (to position {j_pos})", flat,
                                     int(metas[s][_SEND_DISPL, j_pos]), int(metas[s][_SEND_COUNT, j_pos]))
        for r in group:
            out = arrived[r]["dsts"][0]
            slot = None if rdispls else _slot(api, r, out, k)
            at = [int(metas[r][_RECV_DISPL, s_pos]) if rdispls else s_pos * slot for s_pos in range(k)]
            flat = _flat(out)
            _place(api, r, flat, [(at[s_pos], sends[s, r]) for s_pos, s in enumerate(group)], slot)
            _store_flat(out, flat)
            if not arrived[r]["recv_counts_known"]:
                _write_recv_counts(arrived[r]["meta"], metas[r], [sends[s, r].numel() for s in group])
            arrived[r]["wire_bytes"] = sum(sends[r, j].numel() for j in group if j != r) * itemsize

    payload = {"srcs": [src], "dsts": [dst], "meta": meta, "recv_counts_known": bool(recv_counts_known)}
    _meet(api, program, group, payload,
          exchange, lambda arrived: _cost(program, arrived[me]["wire_bytes"], 1),
          _sig(bool(recv_counts_known), rdispls, str(src.dtype), tensors=[meta]))
