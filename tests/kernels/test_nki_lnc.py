"""The NeuronCores of an LNC=2 launch (`kernel[2]`): programs that meet at core_barrier and
sendrecv, run in lockstep (device/nki/lockstep.py), deterministic in values and modelled time."""
from __future__ import annotations

import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl


@nki.jit
def ring_exchange(x):
    """Each core sends its row block to the other; out[r] holds what core r received."""
    rank = nl.program_id(0)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    mine = nl.load(x[rank])
    got = nl.ndarray(mine.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - rank, recv_from_rank=1 - rank, pipe_id=0)
    nl.store(out[rank], got)
    return out


def test_sendrecv_swaps_tiles_between_the_two_cores():
    x = torch.randn(2, 64, 32)
    out = ring_exchange[2](x)
    assert torch.equal(out[0], x[1]) and torch.equal(out[1], x[0])


@nki.jit
def halves_then_swap(x):
    """Each core writes its half of a shared tensor; after the barrier each reads the other half."""
    rank = nl.program_id(0)
    half = x.shape[0] // 2
    shared = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(shared[rank * half:(rank + 1) * half, :], nl.multiply(nl.load(x[rank * half:(rank + 1) * half, :]), 2.0))
    nisa.core_barrier(data=shared, cores=(0, 1))
    other = 1 - rank
    nl.store(out[other * half:(other + 1) * half, :], nl.load(shared[other * half:(other + 1) * half, :]))
    return out


def test_core_barrier_lets_each_core_read_what_the_other_wrote():
    x = torch.randn(256, 16)
    assert torch.equal(halves_then_swap[2](x), x * 2)


def test_collectives_start_on_both_cores_together_and_the_timeline_is_deterministic():
    x = torch.randn(256, 16)
    first = nki.profile(halves_then_swap[2], x)
    barriers = [i for i in first.timeline.instrs if i.name == "core_barrier"]
    assert {i.core for i in barriers} == {0, 1} and barriers[0].start == barriers[1].start
    again = nki.profile(halves_then_swap[2], x)
    assert [(i.name, i.core, i.start) for i in again.timeline.instrs] == \
        [(i.name, i.core, i.start) for i in first.timeline.instrs]


def test_a_collective_outside_an_lnc_launch_says_how_to_launch():
    with pytest.raises(nisa.NkiValidationError, match=r"call the kernel as kernel\[2\]"):
        halves_then_swap(torch.randn(256, 16))


def test_a_core_that_never_reaches_the_barrier_fails_the_launch_naming_both():
    @nki.jit
    def lonely(x):
        if nl.program_id(0) == 0:
            nisa.core_barrier(data=x, cores=(0, 1))

    with pytest.raises(nisa.NkiValidationError, match="program 1 finished while program 0 waits for it at core_barrier"):
        lonely[2](torch.zeros(4, 4))


def test_an_error_in_one_core_reaches_the_caller():
    @nki.jit
    def broken(x):
        if nl.program_id(0) == 1:
            t = nl.ndarray((256, 4), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=t, value=0.0)
        nisa.core_barrier(data=x, cores=(0, 1))

    with pytest.raises(nisa.NkiValidationError, match="memset dst partition dimension 256 exceeds maximum 128"):
        broken[2](torch.zeros(4, 4))
