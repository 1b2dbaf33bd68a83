"""nki.isa's instructions between the NeuronCores of a logical NeuronCore (LNC=2): core_barrier
and sendrecv. The programs of an `kernel[2]` launch meet at them in lockstep (Note [Lockstep
programs] in lockstep.py), and the timeline starts a collective on every core when the last
one reaches it."""
from __future__ import annotations

from . import costs
from .constants import dma_engine, engine
from .errors import NkiValidationError
from .operands import choose_engine, close_psum, tile
from .program import current
from .tensor import SBUF, NkiTensor
from .timeline import Instr


def _lnc_program(instr: str):
    program = current()
    if program.target.version < 3:
        raise NkiValidationError(f"{instr} is available on NeuronCore-v3 (trn2) and newer")
    if program.lockstep is None:
        raise NkiValidationError(f"{instr} synchronises the NeuronCores of an LNC launch: call the kernel as "
                                 f"kernel[2](...) so that two programs run, one per NeuronCore")
    return program


def _key(program, kind: str, pipe) -> tuple:
    """The n-th collective of this kind (and pipe) of every program is the same one."""
    n = program.collectives.get((kind, pipe), 0)
    program.collectives[(kind, pipe)] = n + 1
    return (kind, pipe, n)


def core_barrier(data: NkiTensor, cores, engine=engine.gpsimd, name=None):
    """Every core in `cores` waits here until all of them have arrived."""
    program = _lnc_program("core_barrier")
    cores = tuple(int(c) for c in cores)
    if cores != (0, 1):
        raise NkiValidationError(f"core_barrier supports cores=(0, 1) only, got {cores}")
    eng = choose_engine("core_barrier", engine, (costs.GPSIMD, costs.VECTOR, costs.SCALAR, costs.TENSOR, "sync"),
                        costs.GPSIMD)
    eng = costs.GPSIMD if eng == "sync" else eng
    # the remote semaphore update, then the wait: "semaphore-to-start latency (~1300 ns cross-engine)"
    cost = costs.Cost(costs.cycles_ns(program.target, eng, costs.MIN_II_CYCLES), costs.DMA_LATENCY_NS)
    mine = (program, Instr("core_barrier", eng, cost, [data] if isinstance(data, NkiTensor) else [], []))
    program.lockstep.meet(program.rank, _key(program, "core_barrier", None), cores, mine,
                          lambda arrived: program.launch.timeline.issue_joint(list(arrived.values())))


def sendrecv(src, dst, send_to_rank, recv_from_rank, pipe_id, dma_engine=dma_engine.dma, name=None):
    """Send src to send_to_rank's dst while receiving recv_from_rank's src into this dst."""
    program = _lnc_program("sendrecv")
    tile("sendrecv", "src", src, buffers=(SBUF,))
    tile("sendrecv", "dst", dst, buffers=(SBUF,))
    if src.dtype != dst.dtype or src.shape != dst.shape:
        raise NkiValidationError(f"sendrecv src and dst must have one dtype and shape, got {src.dtype} {src.shape} "
                                 f"and {dst.dtype} {dst.shape}")
    me, to, frm = program.rank, int(send_to_rank), int(recv_from_rank)
    if to not in (0, 1) or frm not in (0, 1):
        raise NkiValidationError(f"sendrecv ranks must be 0 or 1 (the two cores of an LNC=2 device), got send_to_rank="
                                 f"{to}, recv_from_rank={frm}")
    close_psum(src)
    nbytes = src.size * src.dtype.itemsize
    cost = costs.dma(program.target, nbytes, src.partitions, costs.contiguous_row_bytes(src))
    payload = (program, Instr("sendrecv", costs.DMA, cost, [src], [dst]), src.torch_view().clone(), dst, to, frm)

    def exchange(arrived):
        for rank, (_, _, _, p_dst, _, p_frm) in arrived.items():
            sender = arrived.get(p_frm)
            if sender is None or sender[4] != rank:
                raise NkiValidationError(f"sendrecv pipe {pipe_id}: rank {rank} receives from {p_frm}, which sends to "
                                         f"{sender[4] if sender else 'nobody'}")
            if sender[2].shape != p_dst.shape or sender[3].dtype != p_dst.dtype:
                raise NkiValidationError(f"sendrecv pipe {pipe_id}: rank {p_frm} sends {tuple(sender[2].shape)} "
                                         f"{sender[3].dtype}, rank {rank} receives into {p_dst.shape} {p_dst.dtype}")
        for rank, (_, _, _, p_dst, _, p_frm) in arrived.items():
            p_dst.torch_view().copy_(arrived[p_frm][2])
        program.launch.timeline.issue_joint([(p, i) for p, i, *_ in arrived.values()])

    participants = tuple(sorted({me, to, frm}))
    program.lockstep.meet(me, _key(program, "sendrecv", pipe_id), participants, payload, exchange)
