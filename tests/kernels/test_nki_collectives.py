"""nki.collectives between the ranks of an `nki.run_ranks` launch (device/nki/collectives.py,
Note [Rank launches] in device/nki/ranks.py): values against references computed here, both
memories, sub-groups, the refusals, determinism and the price's growth with bytes."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.collectives as ncc
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl
from adaptive_eager.device.nki import costs
from adaptive_eager.nki.collectives import ReplicaGroup


def _staged(x):
    """x (a kernel argument) copied into shared HBM, where collectives may read it."""
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=t, src=x)
    return t


def _returned(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# --- kernels of our own --------------------------------------------------------------------------
@nki.jit
def reduce_hbm(x, group, op):
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.all_reduce(srcs=[_staged(x)], dsts=[dst], replica_group=group, op=op)
    return _returned(dst)


@nki.jit
def reduce_sbuf(x, group):
    tile = nl.load(x)
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    ncc.all_reduce(srcs=[tile], dsts=[dst], replica_group=group, op=nl.add)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, dst)
    return out


@nki.jit
def reduce_two_hbm(x, y, group):
    dx = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    dy = nl.ndarray(y.shape, dtype=y.dtype, buffer=nl.shared_hbm)
    ncc.all_reduce(srcs=[_staged(x), _staged(y)], dsts=[dx, dy], replica_group=group, op=nl.maximum)
    return _returned(dx), _returned(dy)


@nki.jit
def gather_hbm(x, group, k):
    dst = nl.ndarray((x.shape[0] * k, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.all_gather(srcs=[_staged(x)], dsts=[dst], replica_group=group, collective_dim=0)
    return _returned(dst)


@nki.jit
def gather_sbuf(x, group, k, dim):
    tile = nl.load(x)
    shape = (x.shape[0] * k, x.shape[1]) if dim == 0 else (x.shape[0], x.shape[1] * k)
    dst = nl.ndarray(shape, dtype=x.dtype, buffer=nl.sbuf)
    ncc.all_gather(srcs=[tile], dsts=[dst], replica_group=group, collective_dim=dim)
    out = nl.ndarray(shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, dst)
    return out


@nki.jit
def scatter_hbm(x, group, k):
    dst = nl.ndarray((x.shape[0] // k, x.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.reduce_scatter(srcs=[_staged(x)], dsts=[dst], replica_group=group, collective_dim=0, op=nl.add)
    return _returned(dst)


@nki.jit
def alltoall_hbm(x, group):
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.all_to_all(srcs=[_staged(x)], dsts=[dst], replica_group=group, collective_dim=0)
    return _returned(dst)


@nki.jit
def permute_hbm(x, pairs):
    dst = _staged(x)  # a rank nobody sends to keeps its own values
    ncc.collective_permute(srcs=[_staged(x)], dsts=[dst], source_target_pairs=pairs)
    return _returned(dst)


@nki.jit
def ring_gather_sbuf(x, group, k):
    """An all-gather as k-1 implicit ring steps on two channels (the halves of the free dim):
    out[j] is the block of rank j, placed by current_processing_rank_id."""
    rows, cols = x.shape
    half = cols // 2
    out = nl.ndarray((k, rows, cols), dtype=x.dtype, buffer=nl.shared_hbm)
    held = nl.load(x)
    for step in range(k):
        owner = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=step, replica_group=group)
        nl.store(out[int(owner)], held)
        if step < k - 1:
            got = nl.ndarray((rows, cols), dtype=x.dtype, buffer=nl.sbuf)
            ncc.collective_permute_implicit(srcs_by_channel=[[held[:, :half]], [held[:, half:]]],
                                            dsts_by_channel=[[got[:, :half]], [got[:, half:]]],
                                            replica_group=group, channel_ids=[0, 1])
            held = got
    return out


@nki.jit
def ring_reduce_hbm(x, y, group):
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.collective_permute_implicit_reduce(srcs0_by_channel=[[_staged(x)]], srcs1_by_channel=[[_staged(y)]],
                                           dsts_by_channel=[[dst]], replica_group=group, op=nl.add)
    return _returned(dst)


@nki.jit
def rank_slice(table):
    """The NKI library's rank_id_kernel: rank r copies table[r] by a runtime offset."""
    _, h, w = table.shape
    out = nl.ndarray((h, w), dtype=table.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=table.ap(pattern=[[w, h], [1, w]], scalar_offset=ncc.rank_id(), indirect_dim=0))
    return out


def _per_rank(xs, **extra):
    return lambda r: dict(x=torch.from_numpy(xs[r]) if isinstance(xs[r], np.ndarray) else xs[r], **extra)


# --- values ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,ref", [(nl.add, torch.sum), (nl.maximum, lambda t, dim: t.amax(dim)),
                                    (nl.minimum, lambda t, dim: t.amin(dim))], ids=["add", "max", "min"])
def test_all_reduce_in_hbm_matches_reference_for_each_op(op, ref):
    xs = torch.randn(4, 64, 48)
    out = nki.run_ranks(reduce_hbm, 4, _per_rank(xs, group=ReplicaGroup([[0, 1, 2, 3]]), op=op))
    want = ref(xs, dim=0)
    for r in range(4):
        torch.testing.assert_close(out[r], want, rtol=1e-6, atol=1e-5)


def test_all_reduce_accumulates_bf16_in_float32_and_rounds_once():
    # bf16 values whose pairwise bf16 sums would round differently from one float32 sum
    xs = (torch.randn(4, 32, 64) * torch.tensor([1.0, 1e-2, 1e-2, 1e-2]).view(4, 1, 1)).to(torch.bfloat16)
    out = nki.run_ranks(reduce_hbm, 4, _per_rank(xs, group=ReplicaGroup([[0, 1, 2, 3]]), op=nl.add))
    once = (xs[0].float() + xs[1].float() + xs[2].float() + xs[3].float()).to(torch.bfloat16)
    stepwise = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    assert not torch.equal(once, stepwise)  # the test can tell the two apart
    for r in range(4):
        assert torch.equal(out[r], once)


def test_all_reduce_in_sbuf_matches_reference():
    xs = torch.randn(2, 128, 32)
    out = nki.run_ranks(reduce_sbuf, 2, _per_rank(xs, group=ReplicaGroup([[0, 1]])))
    for r in range(2):
        torch.testing.assert_close(out[r], xs[0] + xs[1])


def test_all_reduce_of_several_hbm_tensors_in_one_call():
    xs, ys = torch.randn(2, 16, 8), torch.randn(2, 4, 64)
    out = nki.run_ranks(reduce_two_hbm, 2, lambda r: dict(x=xs[r], y=ys[r], group=ReplicaGroup([[0, 1]])))
    for r in range(2):
        assert torch.equal(out[r][0], xs.amax(0)) and torch.equal(out[r][1], ys.amax(0))


def test_sub_groups_reduce_separately():
    xs = torch.randn(4, 16, 16)
    out = nki.run_ranks(reduce_hbm, 4, _per_rank(xs, group=ReplicaGroup([[0, 2], [1, 3]]), op=nl.add))
    for r, partner in [(0, 2), (1, 3), (2, 0), (3, 1)]:
        torch.testing.assert_close(out[r], xs[min(r, partner)] + xs[max(r, partner)])


def test_all_gather_in_hbm_concatenates_in_rank_list_order():
    xs = torch.randn(4, 8, 16)
    group = ReplicaGroup([[3, 1], [0, 2]])  # the list's order, not the ranks' numbers
    out = nki.run_ranks(gather_hbm, 4, _per_rank(xs, group=group, k=2))
    assert torch.equal(out[1], torch.cat([xs[3], xs[1]])) and torch.equal(out[3], out[1])
    assert torch.equal(out[0], torch.cat([xs[0], xs[2]])) and torch.equal(out[2], out[0])


@pytest.mark.parametrize("dim", [0, 1])
def test_all_gather_in_sbuf_along_either_dim(dim):
    xs = torch.randn(2, 32, 16)
    out = nki.run_ranks(gather_sbuf, 2, _per_rank(xs, group=ReplicaGroup([[0, 1]]), k=2, dim=dim))
    for r in range(2):
        assert torch.equal(out[r], torch.cat([xs[0], xs[1]], dim=dim))


def test_reduce_scatter_gives_the_rank_at_position_i_chunk_i_of_the_sum():
    xs = torch.randn(4, 16, 8)
    group = ReplicaGroup([[0, 1, 2, 3]])
    out = nki.run_ranks(scatter_hbm, 4, _per_rank(xs, group=group, k=4))
    total = xs.sum(0)
    for r in range(4):
        torch.testing.assert_close(out[r], total[4 * r:4 * r + 4], rtol=1e-6, atol=1e-6)


def test_all_to_all_sends_chunk_j_to_the_rank_at_position_j():
    xs = torch.randn(4, 8, 4)
    out = nki.run_ranks(alltoall_hbm, 4, _per_rank(xs, group=ReplicaGroup([[0, 1, 2, 3]])))
    for r in range(4):
        assert torch.equal(out[r], torch.cat([xs[s][2 * r:2 * r + 2] for s in range(4)]))


def test_collective_permute_moves_along_pairs_and_leaves_unnamed_targets_alone():
    xs = torch.randn(4, 8, 8)
    pairs = [(0, 1), (1, 0), (2, 3)]  # rank 2 receives from nobody
    out = nki.run_ranks(permute_hbm, 4, _per_rank(xs, pairs=pairs))
    assert torch.equal(out[0], xs[1]) and torch.equal(out[1], xs[0]) and torch.equal(out[3], xs[2])
    assert torch.equal(out[2], xs[2])


def test_implicit_ring_of_k_minus_1_steps_on_two_channels_gathers_every_block():
    xs = torch.randn(4, 32, 16)
    group = ReplicaGroup([[0, 1, 2, 3]])
    out = nki.run_ranks(ring_gather_sbuf, 4, _per_rank(xs, group=group, k=4))
    for r in range(4):
        assert torch.equal(out[r], xs)


def test_implicit_reduce_sends_the_reduced_sources_to_the_successor():
    xs, ys = torch.randn(3 + 1, 8, 8), torch.randn(4, 8, 8)
    group = ReplicaGroup([[0, 1, 2, 3]])
    out = nki.run_ranks(ring_reduce_hbm, 4, lambda r: dict(x=xs[r], y=ys[r], group=group))
    for r in range(4):
        assert torch.equal(out[r], xs[(r - 1) % 4] + ys[(r - 1) % 4])


def test_rank_id_is_each_ranks_index_as_a_runtime_offset():
    table = torch.randn(4, 8, 16)
    out = nki.run_ranks(rank_slice, 4, {"table": table})
    for r in range(4):
        assert torch.equal(out[r], table[r])


def test_each_rank_gets_its_own_copy_of_shared_inputs():
    @nki.jit
    def write_own_rank(x):
        nisa.dma_copy(dst=x, src=nl.full((1, 1), 0, dtype=x.dtype, buffer=nl.sbuf))  # rank 0's write
        return _returned(_staged(x))

    x = torch.ones(1, 1)
    out = nki.run_ranks(write_own_rank, 2, {"x": x})
    assert torch.equal(x, torch.ones(1, 1)) and all(o.item() == 0 for o in out)


# --- imports --------------------------------------------------------------------------------------
def test_import_nki_collectives_after_install_is_the_emulators_module():
    installed = sys.modules.get("nki") is nki
    nki.install()
    try:
        import nki.collectives as real_name  # noqa: PLC0415
        from nki.collectives import ReplicaGroup as rg  # noqa: PLC0415
        assert real_name is ncc and rg is ReplicaGroup
    finally:
        if not installed:
            nki.uninstall()


# --- refusals -------------------------------------------------------------------------------------
def _refused(kernel, n, inputs, *words):
    with pytest.raises(nki.NkiValidationError) as err:
        nki.run_ranks(kernel, n, inputs)
    for w in words:
        assert w in str(err.value), str(err.value)


@nki.jit
def mixed(x, group):
    dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    ncc.all_reduce(srcs=[_staged(x)], dsts=[dst], replica_group=group, op=nl.add)
    return x


@nki.jit
def two_sbuf(x, group):
    a, b = nl.load(x), nl.load(x)
    ncc.all_reduce(srcs=[a, b], dsts=[a, b], replica_group=group, op=nl.add)
    return x


@nki.jit
def alltoall_sbuf(x, group):
    a = nl.load(x)
    ncc.all_to_all(srcs=[a], dsts=[a], replica_group=group, collective_dim=0)
    return x


@nki.jit
def on_argument(x, group):
    ncc.all_reduce(srcs=[x], dsts=[x], replica_group=group, op=nl.add)
    return x


@nki.jit
def gather_dim1_hbm(x, group):
    dst = nl.ndarray((x.shape[0], x.shape[1] * 2), dtype=x.dtype, buffer=nl.shared_hbm)
    ncc.all_gather(srcs=[_staged(x)], dsts=[dst], replica_group=group, collective_dim=1)
    return x


def test_mixing_hbm_and_sbuf_is_refused_with_the_fix():
    _refused(mixed, 2, {"x": torch.randn(4, 4), "group": ReplicaGroup([[0, 1]])}, "mix HBM and SBUF", "dma_copy")


def test_several_sbuf_tensors_in_one_call_are_refused():
    _refused(two_sbuf, 2, {"x": torch.randn(4, 4), "group": ReplicaGroup([[0, 1]])}, "only for HBM", "one call per")


def test_all_to_all_in_sbuf_is_refused():
    _refused(alltoall_sbuf, 2, {"x": torch.randn(4, 4), "group": ReplicaGroup([[0, 1]])}, "HBM tensors only")


def test_a_kernel_argument_as_operand_is_refused():
    _refused(on_argument, 2, {"x": torch.randn(4, 4), "group": ReplicaGroup([[0, 1]])}, "IO tensors", "shared_hbm")


def test_collective_dim_1_in_hbm_is_refused():
    _refused(gather_dim1_hbm, 2, {"x": torch.randn(4, 4), "group": ReplicaGroup([[0, 1]])}, "collective_dim 1", "[0]")


@pytest.mark.parametrize("groups,words", [
    ([[0, 1], [1, 2, 3]], ["rank 1 appears twice", "must not overlap"]),
    ([[0, 1, 2, 3, 4]], ["rank 4", "out of range", "[0, 4)"]),
    ([[0, 1], [2]], ["rank 3 is in no sub-group"]),
    ([[0, 1], []], ["empty rank list"]),
], ids=["overlap", "out_of_range", "rank_left_out", "empty"])
def test_bad_replica_groups_are_refused(groups, words):
    _refused(reduce_hbm, 4, {"x": torch.randn(4, 4), "group": ReplicaGroup(groups), "op": nl.add}, *words)


def test_unsupported_reduce_op_is_refused():
    _refused(reduce_hbm, 2, {"x": torch.randn(4, 4), "group": ReplicaGroup([[0, 1]]), "op": nl.multiply},
             "nl.add, nl.minimum or nl.maximum", "multiply")


def test_ranks_that_disagree_on_shapes_are_refused():
    _refused(reduce_hbm, 2, lambda r: {"x": torch.randn(4 + r, 4), "group": ReplicaGroup([[0, 1]]), "op": nl.add},
             "every rank must pass the same shapes")


def test_too_many_channels_for_a_sub_group_are_refused():
    @nki.jit
    def three_channels(x, group):
        t = nl.load(x)
        ncc.collective_permute_implicit(srcs_by_channel=[[t[:, 0:2]], [t[:, 2:4]], [t[:, 4:6]]],
                                        dsts_by_channel=[[t[:, 0:2]], [t[:, 2:4]], [t[:, 4:6]]],
                                        replica_group=group, channel_ids=[0, 1, 2])
        return x

    _refused(three_channels, 4, {"x": torch.randn(4, 6), "group": ReplicaGroup([[0, 1], [2, 3]])},
             "3 channels", "at most 2")


def test_collectives_outside_a_rank_launch_are_refused_naming_run_ranks():
    with pytest.raises(nki.NkiValidationError, match="run_ranks"):
        reduce_hbm(torch.randn(4, 4), ReplicaGroup([[0]]), nl.add)


# --- determinism and price ------------------------------------------------------------------------
def test_values_and_modelled_times_repeat_exactly():
    xs = torch.randn(4, 64, 32)
    runs = []
    for _ in range(5):
        reports = nki.profile_ranks(ring_gather_sbuf, 4, _per_rank(xs, group=ReplicaGroup([[0, 1, 2, 3]]), k=4))
        runs.append([(r.result.clone(), r.timeline.total_ns, [(i.name, i.start, i.end) for i in r.timeline.instrs])
                     for r in reports])
    for run in runs[1:]:
        for (v0, t0, i0), (v, t, i) in zip(runs[0], run):
            assert torch.equal(v, v0) and t == t0 and i == i0


def _collective_ns(kernel, n, inputs, name):
    reports = nki.profile_ranks(kernel, n, inputs)
    return [next(i.ns for i in r.timeline.instrs if i.name == name) for r in reports]


@pytest.mark.parametrize("rows", [8, 64])
def test_all_gather_price_is_hops_plus_bytes_over_the_link_share(rows):
    k, cols = 4, 256
    xs = torch.randn(k, rows, cols)
    ns = _collective_ns(gather_hbm, k, _per_rank(xs, group=ReplicaGroup([list(range(k))]), k=k), "all_gather")
    from adaptive_eager.device.nki.target import current_target  # noqa: PLC0415
    from adaptive_eager.device.nki.kernel import logical_cores  # noqa: PLC0415
    rate = costs.collective_link_bytes_per_ns(current_target(), logical_cores())
    want = (k - 1) * costs.COLLECTIVE_HOP_NS + (k - 1) * rows * cols * 4 / rate
    assert ns == pytest.approx([want] * k)


def test_all_reduce_price_grows_with_bytes_as_the_model_says():
    k = 2
    small, big = torch.randn(k, 16, 128), torch.randn(k, 16, 1024)
    group = ReplicaGroup([[0, 1]])
    ns_small = _collective_ns(reduce_hbm, k, _per_rank(small, group=group, op=nl.add), "all_reduce")[0]
    ns_big = _collective_ns(reduce_hbm, k, _per_rank(big, group=group, op=nl.add), "all_reduce")[0]
    from adaptive_eager.device.nki.target import current_target  # noqa: PLC0415
    from adaptive_eager.device.nki.kernel import logical_cores  # noqa: PLC0415
    target = current_target()
    rate = costs.collective_link_bytes_per_ns(target, logical_cores())
    reduce_rate = costs.DMA_ENGINES * costs.DMA_BYTES_PER_NS[target.version] * \
        costs.COLLECTIVE_REDUCE_EFFICIENCY[target.version]
    extra = (big[0].nbytes - small[0].nbytes)
    assert ns_big - ns_small == pytest.approx(2 * (k - 1) / k * extra / rate + (k - 1) / k * extra / reduce_rate)
    assert ns_big > ns_small


def test_a_collective_starts_on_every_rank_when_the_last_rank_reaches_it():
    @nki.jit
    def late(x, group):
        src = _staged(x)
        if int(ncc.rank_id()) == 1:  # rank 1 copies 16 more times before it arrives
            for _ in range(16):
                nisa.dma_copy(dst=src, src=x)
        dst = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=group, op=nl.add)
        return _returned(dst)

    reports = nki.profile_ranks(late, 2, {"x": torch.randn(128, 256), "group": ReplicaGroup([[0, 1]])})
    starts = [next(i.start for i in r.timeline.instrs if i.name == "all_reduce") for r in reports]
    copies_1 = [i for i in reports[1].timeline.instrs if i.name == "dma_copy"]
    assert starts[0] == starts[1] >= copies_1[16].end


# --- an LNC=2 grid inside each rank ----------------------------------------------------------------
@nki.jit
def gather_per_core(x, group, k):
    """Each NeuronCore of a rank gathers its half of the rows, after a barrier between the two."""
    core = nl.program_id(0)
    half = x.shape[0] // 2
    out = nl.ndarray((x.shape[0], x.shape[1] * k), dtype=x.dtype, buffer=nl.shared_hbm)
    mine = nl.load(x[core * half:(core + 1) * half, :])
    got = nl.ndarray((half, x.shape[1] * k), dtype=x.dtype, buffer=nl.sbuf)
    nisa.core_barrier(data=out, cores=(0, 1))
    ncc.all_gather(srcs=[mine], dsts=[got], replica_group=group, collective_dim=1)
    nl.store(out[core * half:(core + 1) * half, :], got)
    return out


def test_an_lnc2_grid_runs_inside_each_rank_and_each_core_meets_its_counterparts():
    xs = torch.randn(4, 64, 8)
    out = nki.run_ranks(gather_per_core[2], 4, _per_rank(xs, group=ReplicaGroup([[0, 1, 2, 3]]), k=4))
    for r in range(4):
        assert torch.equal(out[r], torch.cat(list(xs), dim=1))


def test_core_barriers_of_different_ranks_do_not_meet_each_other():
    @nki.jit
    def barrier_on_rank_0_only(x):
        if int(ncc.rank_id()) == 0:
            nisa.core_barrier(data=x, cores=(0, 1))
        return x

    # were rank 0's barrier keyed like rank 1's programs, this would still pass: so also check
    # that a barrier rank 1 never reaches does not release rank 0's programs from each other
    nki.run_ranks(barrier_on_rank_0_only[2], 2, {"x": torch.randn(4, 4)})

    @nki.jit
    def barrier_core_0_only(x):
        if int(ncc.rank_id()) == 1 or nl.program_id(0) == 0:
            nisa.core_barrier(data=x, cores=(0, 1))
        return x

    with pytest.raises(nki.NkiValidationError, match="core_barrier"):
        nki.run_ranks(barrier_core_0_only[2], 2, {"x": torch.randn(4, 4)})
