"""The device's FLOP counts agree with torch's flop_counter: the C++ eager path's, and
dispatch/pricing.py's (custom kernels), which calls torch's formulas on shapes it computes
itself (flop_registry's wrapper costs ~35 us per op).
"""
import pytest
import torch
from torch.utils.flop_counter import flop_registry

import adaptive_eager
from adaptive_eager.dispatch.pricing import _shape_flop_formula, _shape_of

aten = torch.ops.aten

CASES = {
    "mm": (aten.mm.default, lambda: (torch.randn(4, 8), torch.randn(8, 5))),
    "addmm": (aten.addmm.default, lambda: (torch.randn(5), torch.randn(4, 8), torch.randn(8, 5))),
    "bmm": (aten.bmm.default, lambda: (torch.randn(3, 4, 8), torch.randn(3, 8, 5))),
    "baddbmm": (aten.baddbmm.default,
                lambda: (torch.randn(3, 4, 5), torch.randn(3, 4, 8), torch.randn(3, 8, 5))),
    "convolution": (aten.convolution.default,
                    lambda: (torch.randn(2, 3, 9, 9), torch.randn(6, 3, 3, 3), None,
                             [1, 1], [0, 0], [1, 1], False, [0, 0], 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_flop_count_matches_torch_flop_counter(name):
    op, make = CASES[name]
    args = make()
    out = op(*args)
    expected = flop_registry[op._overloadpacket](*args, out_val=out)
    fn, on_shapes = _shape_flop_formula(op)
    assert on_shapes
    assert fn(*[_shape_of(a) for a in args], out_shape=_shape_of(out)) == expected > 0


def test_ops_without_a_formula_have_none():
    assert _shape_flop_formula(aten.add.Tensor) is None


# Shapes large enough that each op is compute-bound in the cost model, so the time it is
# charged says how many FLOPs it was counted (memory-bound, any count would price the same).
BIG = {
    "mm": (aten.mm.default, lambda: (torch.randn(1024, 1024), torch.randn(1024, 1024))),
    "addmm": (aten.addmm.default, lambda: (torch.randn(1024), torch.randn(1024, 1024), torch.randn(1024, 1024))),
    "bmm": (aten.bmm.default, lambda: (torch.randn(2, 1024, 1024), torch.randn(2, 1024, 1024))),
    "baddbmm": (aten.baddbmm.default,
                lambda: (torch.randn(2, 1024, 1024), torch.randn(2, 1024, 1024), torch.randn(2, 1024, 1024))),
    "convolution": (aten.convolution.default,
                    lambda: (torch.randn(8, 64, 16, 16), torch.randn(64, 64, 3, 3), None,
                             [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
    "conv_transpose": (aten.convolution.default,
                       lambda: (torch.randn(8, 64, 16, 16), torch.randn(64, 64, 3, 3), None,
                                [1, 1], [1, 1], [1, 1], True, [0, 0], 1)),
    "convolution_backward": (aten.convolution_backward.default,
                             lambda: (torch.randn(8, 64, 16, 16), torch.randn(8, 64, 16, 16),
                                      torch.randn(64, 64, 3, 3), None, [1, 1], [1, 1], [1, 1], False,
                                      [0, 0], 1, [True, True, False])),
}


def _on_neuron(a):
    return a.to("neuron") if isinstance(a, torch.Tensor) else a


@pytest.mark.parametrize("name", sorted(BIG))
def test_the_cpp_eager_path_charges_torchs_flop_count(name):
    from adaptive_eager.dispatch import CONTEXT

    op, make = BIG[name]
    args = make()
    out = op(*args)
    flops = flop_registry[op._overloadpacket](*args, out_val=out)
    cost = CONTEXT.runtime.cost
    compute_us = flops * cost.us_per_flop(torch.float32)
    nbytes = sum(t.numel() * t.element_size() for t in (*args, *(out if isinstance(out, tuple) else (out,)))
                 if isinstance(t, torch.Tensor))
    assert compute_us > 2 * nbytes * cost.us_per_byte  # compute-bound: else the test could not fail
    on_neuron = [_on_neuron(a) for a in args]
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        op(*on_neuron)
        s = adaptive_eager.stats()
    assert s.launches == 1
    assert s.device_time_us - s.launch_overhead_us == pytest.approx(compute_us, rel=1e-9)


def _modelled_us(fn, *args):
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        fn(*args)
        s = adaptive_eager.stats()
    assert s.launches == 1
    return s.device_time_us - s.launch_overhead_us


GATHERS = {
    "index": lambda table, rows: table[rows],
    "index_select": lambda table, rows: table.index_select(0, rows),
    "embedding": lambda table, rows: torch.nn.functional.embedding(rows, table),
}


@pytest.mark.parametrize("name", sorted(GATHERS))
def test_a_gather_is_priced_by_the_rows_it_reads_not_the_whole_table(name):
    # Note [Gathers and scatters] (device/csrc/cost/touched.cpp): a paged KV cache's gather read
    # the whole cache, per layer and token, in the model.
    rows = torch.tensor([3, 0, 7, 7, 1, 5, 2, 6]).to("neuron")
    small, large = torch.randn(8, 256).to("neuron"), torch.randn(4096, 256).to("neuron")
    assert _modelled_us(GATHERS[name], large, rows) == pytest.approx(_modelled_us(GATHERS[name], small, rows), rel=1e-12)


SCATTERS = {
    "index_copy_": lambda cache, rows, src: cache.index_copy_(0, rows, src),
    "index_add_": lambda cache, rows, src: cache.index_add_(0, rows, src),
    "scatter_": lambda cache, rows, src: cache.scatter_(0, rows[:, None].expand(-1, 256), src),
    "scatter_add_": lambda cache, rows, src: cache.scatter_add_(0, rows[:, None].expand(-1, 256), src),
    # Note [Index puts]: x[idx] = v
    "index_put_": lambda cache, rows, src: cache.index_put_((rows,), src),
    "index_put_accumulate": lambda cache, rows, src: cache.index_put_((rows,), src, accumulate=True),
    "setitem": lambda cache, rows, src: cache.__setitem__(rows, src),
    "setitem_host_rows": lambda cache, rows, src: cache.__setitem__(rows.cpu(), src),
    "setitem_one_row_broadcast": lambda cache, rows, src: cache.__setitem__(rows, src[0]),
    "setitem_rows_of_a_column_range": lambda cache, rows, src: cache.__setitem__((rows, slice(0, 256)), src),
}


@pytest.mark.parametrize("name", sorted(SCATTERS))
def test_an_in_place_scatter_is_priced_by_the_rows_it_writes_not_the_whole_tensor(name):
    rows = torch.tensor([3, 0, 7, 4, 1, 5, 2, 6]).to("neuron")
    src = torch.randn(8, 256).to("neuron")
    small, large = torch.zeros(8, 256).to("neuron"), torch.zeros(4096, 256).to("neuron")
    assert (_modelled_us(SCATTERS[name], large, rows, src)
            == pytest.approx(_modelled_us(SCATTERS[name], small, rows, src), rel=1e-12))
    # what it writes lands where the CPU puts it
    expected = torch.zeros(4096, 256)
    SCATTERS[name](expected, rows.cpu(), src.cpu())
    assert torch.equal(large.cpu(), expected)


def test_a_boolean_mask_put_is_priced_as_every_element_its_mask_covers():
    """Note [Index puts]: how many entries of a mask are True is data, so a masked put counts
    all the rows the mask covers, the most it can write, whatever the mask holds."""
    row = torch.randn(256).to("neuron")
    table = torch.zeros(4096, 256).to("neuron")
    three = torch.zeros(4096, dtype=torch.bool)
    three[[3, 9, 100]] = True
    put = lambda t, where: t.__setitem__(where, row)
    masked = _modelled_us(put, table, three.to("neuron"))
    assert masked == pytest.approx(_modelled_us(put, table, torch.ones(4096, dtype=torch.bool).to("neuron")), rel=1e-12)
    assert _modelled_us(put, table, torch.tensor([3, 9, 100]).to("neuron")) < masked
    assert torch.equal(table.cpu(), row.cpu().expand(4096, 256))  # the all-True mask's put wrote every row


def _spd(n):
    a = torch.randn(n, n, dtype=torch.float64)
    return a @ a.T + n * torch.eye(n, dtype=torch.float64)


# Note [Ops TorchNeuron runs on the host] (device/csrc/aten/pricing.cpp): torch-neuronx runs
# these on CPU on purpose; the chip runs no kernel and moves their arguments out and results in.
# Called by their aten names: torch.linalg's front ends add small ops of their own (cholesky
# reads its `info` to raise), which run on the device as they would on the chip.
HOST_RUN = {  # the op, and its tensor arguments made from a square matrix
    "linalg_qr": (aten.linalg_qr.default, lambda a: (a,)),
    "_linalg_svd": (aten._linalg_svd.default, lambda a: (a,)),
    "_linalg_eigh": (aten._linalg_eigh.default, lambda a: (a,)),
    "linalg_cholesky_ex": (aten.linalg_cholesky_ex.default, lambda a: (a,)),
    "linalg_inv_ex": (aten.linalg_inv_ex.default, lambda a: (a,)),
    "linalg_lu_factor_ex": (aten.linalg_lu_factor_ex.default, lambda a: (a,)),
    "linalg_ldl_factor_ex": (aten.linalg_ldl_factor_ex.default, lambda a: (a,)),
    "_linalg_det": (aten._linalg_det.default, lambda a: (a,)),
    "_linalg_slogdet": (aten._linalg_slogdet.default, lambda a: (a,)),
    "cholesky_inverse": (aten.cholesky_inverse.default, lambda a: (a,)),
    "triangular_solve": (aten.triangular_solve.default, lambda a: (a[:, :3].contiguous(), a)),
}


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("name", sorted(HOST_RUN))
def test_an_op_torchneuron_runs_on_the_host_is_charged_a_round_trip_not_a_kernel(name, mode):
    from adaptive_eager.dispatch import CONTEXT

    op, arguments_of = HOST_RUN[name]
    args = arguments_of(_spd(64))
    expected = op(*args)
    on_neuron = [t.to("neuron") for t in args]
    # Twice: the second call's arguments have a geometry seen before, which would let an
    # eager op be posted (it was, and charged a launch instead of its round trip).
    for _ in range(2):
        with adaptive_eager.mode(mode):
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            out = op(*on_neuron)
            torch.neuron.synchronize()
            s = adaptive_eager.stats()
        results = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
        for got, want in zip(results, expected if isinstance(expected, tuple) else (expected,)):
            assert torch.equal(got.cpu(), want)  # CPU's kernel's values either way
        assert s.launches == 0 and s.ops == 0, s
        assert s.transfers == 2  # the arguments to the host, the results back
        assert s.transfer_bytes == sum(t.numel() * t.element_size() for t in (*args, *results))
        assert s.device_time_us == pytest.approx(s.transfer_bytes * CONTEXT.runtime.cost.us_per_byte, rel=1e-9)


def test_a_host_run_op_inside_a_fused_launch_is_charged_as_in_eager_mode():
    start = _spd(32)

    def run(mode):
        a = start.to("neuron")
        with adaptive_eager.mode(mode):
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            outs = []
            for _ in range(12):  # repeats: adaptive mode replays it as fused launches
                a = a * 1.0 + 0.0
                outs.append(aten.linalg_inv_ex.default(a)[0].sum())
            torch.neuron.synchronize()
            return adaptive_eager.stats(), torch.stack(outs).cpu()

    eager, eager_out = run("eager")
    adaptive, adaptive_out = run("adaptive")
    assert torch.equal(eager_out, adaptive_out)
    assert adaptive.fused_ops > 0  # else this compares eager with eager
    assert adaptive.transfers == eager.transfers and adaptive.transfer_bytes == eager.transfer_bytes
    assert adaptive.ops == eager.ops  # the host-run op counts as no kernel op in either mode
