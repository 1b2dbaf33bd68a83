"""nki.collectives.all_gather_v and all_to_all_v (device/nki/collectives_v.py): values against
references computed here from each rank's metadata, the recv_counts row, sub-groups addressed by
position, the documented limits as refusals, and the price from the counts at run time."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.collectives as ncc
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl
from adaptive_eager.device.nki import costs
from adaptive_eager.device.nki.kernel import logical_cores
from adaptive_eager.device.nki.target import current_target
from adaptive_eager.nki.collectives import ReplicaGroup
from subproc import run_python

g = torch.Generator().manual_seed(0)


def _staged(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=t, src=x)
    return t


def _returned(t):
    out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def gather_v(x, init, meta, group, known):
    dst, md = _staged(init), _staged(meta)
    ncc.all_gather_v(srcs=[_staged(x)], dsts=[dst], replica_group=group, metadata_tensor=md, recv_counts_known=known)
    return _returned(dst), _returned(md)


@nki.jit
def to_all_v(x, init, meta, group, rdispls):
    dst, md = _staged(init), _staged(meta)
    ncc.all_to_all_v(srcs=[_staged(x)], dsts=[dst], replica_group=group, metadata_tensor=md, has_rdispls=rdispls)
    return _returned(dst), _returned(md)


def _meta(rows):
    return torch.from_numpy(np.asarray(rows, dtype=np.uint32))


# --- all_gather_v ---------------------------------------------------------------------------------
def _gather_inputs(n, k):
    """Rank r sends r + 3 elements from offset r of its 32; dst is 4 slots of 16, filled with -1."""
    xs = torch.randn(n, 4, 8, generator=g)
    metas = [_meta([[r % k + 3] * k, [r] * k, [0] * k]) for r in range(n)]
    return xs, metas


def _gather_reference(xs, metas, group):
    want = torch.full((64,), -1.0)
    for pos, s in enumerate(group):
        count, displ = int(metas[s][0, 0]), int(metas[s][1, 0])
        want[pos * 16:pos * 16 + count] = xs[s].reshape(-1)[displ:displ + count]
    return want.reshape(4, 16)


@pytest.mark.parametrize("groups", [[[0, 1, 2, 3]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[2, 0, 3, 1]]],
                         ids=["one_chip", "two_chips", "list_order"])
def test_all_gather_v_puts_each_ranks_chunk_in_the_slot_of_its_position(groups):
    n = 4 * len(groups)
    xs, metas = _gather_inputs(n, 4)
    out = nki.run_ranks(gather_v, n, lambda r: dict(x=xs[r], init=torch.full((4, 16), -1.0), meta=metas[r],
                                                    group=ReplicaGroup(groups), known=False))
    for group in groups:
        want = _gather_reference(xs, metas, group)
        counts = [int(metas[s][0, 0]) for s in group]
        for r in group:
            dst, md = out[r]
            assert torch.equal(dst, want)  # elements past each chunk keep dst's -1
            assert md[2].tolist() == counts and torch.equal(md[:2], metas[r][:2])


def test_all_gather_v_takes_its_metadata_from_one_sbuf_partition():
    @nki.jit
    def gather_v_sbuf_meta(x, meta, group):
        dst, md = nl.zeros((64,), dtype=x.dtype, buffer=nl.shared_hbm), nl.load(meta)
        ncc.all_gather_v(srcs=[_staged(x)], dsts=[dst], replica_group=group, metadata_tensor=md)
        out = nl.ndarray(meta.shape, dtype=meta.dtype, buffer=nl.shared_hbm)
        nl.store(out, md)
        return _returned(dst), out

    xs = torch.randn(4, 32, generator=g)
    metas = [_meta([[[r + 1] * 4, [2] * 4, [0] * 4]]) for r in range(4)]
    group = ReplicaGroup([[0, 1, 2, 3]])
    out = nki.run_ranks(gather_v_sbuf_meta, 4, lambda r: dict(x=xs[r], meta=metas[r], group=group))
    want = torch.zeros(64)
    for s in range(4):
        want[s * 16:s * 16 + s + 1] = xs[s][2:2 + s + 1]
    for dst, md in out:
        assert torch.equal(dst, want) and md[0, 2].tolist() == [1, 2, 3, 4]


def test_the_v_collectives_module_imports_first_on_its_own():
    # collectives.py re-exports it: a cycle between the two once broke this import order
    done = run_python("import adaptive_eager.device.nki.collectives_v as m; print(m.all_to_all_v.__name__)")
    assert done.returncode == 0 and done.stdout.strip() == "all_to_all_v", done.stderr


def test_all_gather_v_leaves_recv_counts_alone_when_they_are_known():
    xs, metas = _gather_inputs(4, 4)
    metas = [torch.cat([m[:2], _meta([[7, 7, 7, 7]])]) for m in metas]
    out = nki.run_ranks(gather_v, 4, lambda r: dict(x=xs[r], init=torch.full((4, 16), -1.0), meta=metas[r],
                                                    group=ReplicaGroup([[0, 1, 2, 3]]), known=True))
    assert all(md[2].tolist() == [7, 7, 7, 7] for _, md in out)


def _refused(kernel, n, inputs, *words):
    with pytest.raises(nki.NkiValidationError) as err:
        nki.run_ranks(kernel, n, inputs)
    for w in words:
        assert w in str(err.value), str(err.value)


def _gather_call(n, groups, meta=None, init=None, known=False):
    xs, metas = _gather_inputs(n, 4)
    return lambda r: dict(x=xs[r], init=torch.full((4, 16), -1.0) if init is None else init,
                          meta=metas[r] if meta is None else meta, group=ReplicaGroup(groups), known=known)


@pytest.mark.parametrize("groups,words", [
    ([[0, 1], [2, 3]], ["exactly 4 ranks of one chip", "[0, 1]"]),
    ([[0, 1, 4, 5], [2, 3, 6, 7]], ["exactly 4 ranks of one chip", "[0, 1, 4, 5]"]),
], ids=["two_ranks", "across_chips"])
def test_all_gather_v_refuses_rank_lists_other_than_one_chips_four(groups, words):
    _refused(gather_v, 8 if max(map(max, groups)) > 3 else 4, _gather_call(8, groups), *words)


def test_all_gather_v_refuses_lnc1(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    _refused(gather_v, 4, _gather_call(4, [[0, 1, 2, 3]]), "only LNC=2", "NEURON_LOGICAL_NC_CONFIG=2")


def test_all_gather_v_refuses_has_rdispls():
    @nki.jit
    def with_rdispls(x, meta, group):
        dst, md = nl.ndarray((64,), dtype=x.dtype, buffer=nl.shared_hbm), _staged(meta)
        ncc.all_gather_v(srcs=[_staged(x)], dsts=[dst], replica_group=group, metadata_tensor=md, has_rdispls=True)
        return x

    inputs = {"x": torch.randn(32), "meta": _meta([[1] * 4] * 4), "group": ReplicaGroup([[0, 1, 2, 3]])}
    _refused(with_rdispls, 4, inputs, "has_rdispls=True is not supported")


@pytest.mark.parametrize("meta,words", [
    (_meta([[3] * 4, [0] * 4]), ["metadata_tensor must be (3, 4) uint32", "(2, 4)"]),
    (torch.zeros(3, 4), ["must be a uint32 NKI tensor"]),
    (_meta([[17] * 4, [0] * 4, [0] * 4]), ["sends 17 elements", "slot of 16"]),
    (_meta([[3] * 4, [30] * 4, [0] * 4]), ["src[30:33]", "past its 32 elements"]),
], ids=["two_rows", "float_metadata", "chunk_over_slot", "chunk_past_src"])
def test_all_gather_v_refuses_bad_metadata_naming_it(meta, words):
    _refused(gather_v, 4, _gather_call(4, [[0, 1, 2, 3]], meta=meta), *words)


def test_all_gather_v_refuses_a_dst_that_does_not_split_into_equal_slots():
    _refused(gather_v, 4, _gather_call(4, [[0, 1, 2, 3]], init=torch.zeros(3, 7)), "21 elements", "4 equal slots")


# --- all_to_all_v (trn3: NeuronSwitch) --------------------------------------------------------------
@pytest.fixture
def trn3(monkeypatch):
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")


def _a2a_inputs(n, rdispls):
    """Rank s sends counts[s][j] <= 5 int32 elements (past float32's exact range) to position j,
    from consecutive offsets; with rdispls, receivers pack the chunks in reverse sender order."""
    counts = torch.randint(0, 6, (n, n), generator=g)
    xs = (torch.arange(n * 40, dtype=torch.int64).reshape(n, 40) + (1 << 30)).to(torch.int32)
    metas = []
    for r in range(n):
        send_displs = torch.cumsum(counts[r], 0) - counts[r]
        rows = [counts[r].tolist(), send_displs.tolist(), [0] * n]
        if rdispls:
            incoming = counts[:, r].flip(0)
            rows.append((torch.cumsum(incoming, 0) - incoming).flip(0).tolist())
        metas.append(_meta(rows))
    return xs, metas, counts


def _a2a_reference(xs, metas, counts, r, rdispls, n):
    want = torch.full((n * 5,), -1, dtype=torch.int32)
    for s in range(n):
        c, d = int(counts[s, r]), int(metas[s][1, r])
        at = int(metas[r][3, s]) if rdispls else s * 5
        want[at:at + c] = xs[s][d:d + c]
    return want


@pytest.mark.parametrize("rdispls", [False, True], ids=["equal_slots", "recv_displs"])
def test_all_to_all_v_sends_each_positions_count_and_places_it_as_the_metadata_says(trn3, rdispls):
    n = 8
    xs, metas, counts = _a2a_inputs(n, rdispls)
    out = nki.run_ranks(to_all_v, n, lambda r: dict(x=xs[r], init=torch.full((n * 5,), -1, dtype=torch.int32),
                                                    meta=metas[r], group=ReplicaGroup([list(range(n))]),
                                                    rdispls=rdispls))
    for r in range(n):
        dst, md = out[r]
        assert torch.equal(dst, _a2a_reference(xs, metas, counts, r, rdispls, n))  # exact: no float32 on the way
        assert md[2].tolist() == counts[:, r].tolist()


def test_all_to_all_v_repeats_values_and_times_exactly(trn3):
    xs, metas, _ = _a2a_inputs(8, False)
    runs = []
    for _ in range(3):
        reports = nki.profile_ranks(to_all_v, 8, lambda r: dict(x=xs[r], init=torch.zeros(40, dtype=torch.int32),
                                                               meta=metas[r], group=ReplicaGroup([list(range(8))]),
                                                               rdispls=False))
        runs.append([(r.result[0].clone(), [(i.name, i.start, i.end) for i in r.timeline.instrs]) for r in reports])
    for run in runs[1:]:
        assert all(torch.equal(v, v0) and i == i0 for (v, i), (v0, i0) in zip(run, runs[0]))


def _a2a_call(n, groups, meta_of=None, rdispls=False, inputs=None):
    xs, metas, _ = inputs or _a2a_inputs(n, rdispls)
    return lambda r: dict(x=xs[r], init=torch.zeros(n * 5, dtype=torch.int32),
                          meta=metas[r] if meta_of is None else meta_of(r), group=ReplicaGroup(groups),
                          rdispls=rdispls)


def test_all_to_all_v_off_trn3_is_refused_as_inter_node_only():
    _refused(to_all_v, 4, _a2a_call(4, [[0, 1, 2, 3]]), "only inter-node replica groups", "trn3")


@pytest.mark.parametrize("groups,words", [
    ([[0, 1, 2, 3], [4, 5, 6, 7]], ["more than one device", "[0, 1, 2, 3]"]),
    ([[0, 1, 2, 3, 4, 5], [6, 7]], ["every rank of each device", "send_count 0"]),
], ids=["one_device", "part_of_a_device"])
def test_all_to_all_v_on_trn3_refuses_groups_not_of_whole_devices(trn3, groups, words):
    _refused(to_all_v, 8, _a2a_call(8, groups), *words)


def test_all_to_all_v_refuses_overlapping_recv_displs(trn3):
    ones = _meta([[1] * 8, list(range(8)), [0] * 8, [0, 0, 2, 3, 4, 5, 6, 7]])
    _refused(to_all_v, 8, _a2a_call(8, [list(range(8))], meta_of=lambda r: ones, rdispls=True),
             "positions 0 and 1 overlap")


# --- price -----------------------------------------------------------------------------------------
def test_v_collectives_are_priced_from_the_counts_at_run_time(trn3):
    n = 8
    xs, metas, counts = inputs = _a2a_inputs(n, False)
    reports = nki.profile_ranks(to_all_v, n, _a2a_call(n, [list(range(n))], inputs=inputs))
    rate = costs.collective_link_bytes_per_ns(current_target(), logical_cores())
    for r, report in enumerate(reports):
        ns = next(i.ns for i in report.timeline.instrs if i.name == "all_to_all_v")
        sent = int(counts[r].sum() - counts[r, r]) * 4
        assert ns == pytest.approx(costs.COLLECTIVE_HOP_NS + sent / rate)


def test_all_gather_v_is_priced_as_a_ring_forwarding_the_other_ranks_chunks():
    xs, metas = _gather_inputs(4, 4)
    reports = nki.profile_ranks(gather_v, 4, lambda r: dict(x=xs[r], init=torch.zeros(4, 16), meta=metas[r],
                                                            group=ReplicaGroup([[0, 1, 2, 3]]), known=False))
    rate = costs.collective_link_bytes_per_ns(current_target(), logical_cores())
    counts = [int(m[0, 0]) for m in metas]
    for r, report in enumerate(reports):
        ns = next(i.ns for i in report.timeline.instrs if i.name == "all_gather_v")
        assert ns == pytest.approx(3 * costs.COLLECTIVE_HOP_NS + (sum(counts) - counts[r]) * 4 / rate)
