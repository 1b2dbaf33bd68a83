"""nki.isa on the emulated NeuronCore: each instruction's documented semantics, checked
against torch, and each documented limit raising an error that names the instruction, the
operand, the limit and the value."""
from __future__ import annotations

import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl
from adaptive_eager.device.nki import dtypes as dt

g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g)


def filled(values: torch.Tensor, dtype=nl.float32, buffer=nl.sbuf):
    t = nl.ndarray(tuple(values.shape), dtype, buffer)
    t.torch_view().copy_(dt.encode(values, t.dtype))
    return t


def out(shape, dtype=nl.float32, buffer=nl.sbuf):
    return nl.ndarray(shape, dtype, buffer)


# --- data movement ------------------------------------------------------------------------------------
def test_dma_copy_moves_bits_between_hbm_and_sbuf_and_converts_dtypes_through_float32():
    x = rand(128, 64)
    hbm = filled(x, buffer=nl.shared_hbm)
    tile = out((128, 64))
    nisa.dma_copy(dst=tile, src=hbm)
    assert torch.equal(tile.values(), x)
    low = out((128, 64), nl.bfloat16)
    nisa.dma_copy(dst=low, src=tile)
    assert torch.equal(low.values(), x.bfloat16().float())


def test_dma_copy_needs_equal_element_counts_and_no_psum():
    with pytest.raises(nisa.NkiValidationError, match="dma_copy src has 64 elements.*dst has 32"):
        nisa.dma_copy(dst=out((1, 32)), src=out((1, 64)))
    with pytest.raises(nisa.NkiValidationError, match="dma_copy dst must be in nl.sbuf or nl.private_hbm or nl.shared_hbm"):
        nisa.dma_copy(dst=out((4, 4), buffer=nl.psum), src=out((4, 4)))


def test_dma_copy_gathers_rows_by_a_vector_offset_and_scatters_them_back():
    data = rand(16, 8)
    hbm = filled(data, buffer=nl.shared_hbm)
    idx = filled(torch.tensor([[3], [0], [15], [7]]), nl.uint32)
    rows = out((4, 8))
    nisa.dma_copy(dst=rows, src=hbm.ap(pattern=[[8, 4], [1, 8]], vector_offset=idx, indirect_dim=0))
    assert torch.equal(rows.values(), data[[3, 0, 15, 7]])
    target = filled(torch.zeros(16, 8), buffer=nl.shared_hbm)
    nisa.dma_copy(dst=target.ap(pattern=[[8, 4], [1, 8]], vector_offset=idx, indirect_dim=0), src=rows)
    expect = torch.zeros(16, 8)
    expect[[3, 0, 15, 7]] = data[[3, 0, 15, 7]]
    assert torch.equal(target.values(), expect)


def test_dma_copy_with_a_runtime_row_past_the_end_raises_or_skips():
    hbm = filled(rand(4, 8), buffer=nl.shared_hbm)
    idx = filled(torch.tensor([[9]]), nl.int32)
    dst = out((1, 8))
    nisa.memset(dst, 0.0)
    view = hbm.ap(pattern=[[8, 1], [1, 8]], scalar_offset=idx, indirect_dim=0)
    with pytest.raises(nisa.NkiValidationError, match=r"runtime index 9 is out of bounds \[0, 4\)"):
        nisa.dma_copy(dst=dst, src=view)
    nisa.dma_copy(dst=dst, src=view, oob_mode=nisa.oob_mode.skip)
    assert torch.equal(dst.values(), torch.zeros(1, 8))


def test_dma_transpose_permutes_2d_and_3d_tiles():
    x = rand(16, 32)
    t = out((32, 16))
    nisa.dma_transpose(dst=t, src=filled(x, buffer=nl.shared_hbm))
    assert torch.equal(t.values(), x.t())
    y = rand(2, 4, 8)
    t3 = out((8, 4, 2))
    nisa.dma_transpose(dst=t3, src=filled(y, buffer=nl.shared_hbm))
    assert torch.equal(t3.values(), y.permute(2, 1, 0))


def test_tensor_copy_is_bit_exact_for_equal_dtypes_and_rounds_otherwise():
    x = rand(8, 16)
    x[0, 0] = float("nan")
    src = filled(x)
    same = out((8, 16))
    nisa.tensor_copy(dst=same, src=src)
    assert torch.equal(same.torch_view().view(torch.int32), src.torch_view().view(torch.int32))
    half = out((8, 4, 4), nl.float16)  # same elements per partition, another shape
    nisa.tensor_copy(dst=half, src=src)
    assert torch.equal(half.values().reshape(8, 16).nan_to_num(), x.half().float().nan_to_num())


def test_gpsimd_cannot_touch_psum():
    with pytest.raises(nisa.NkiValidationError, match="GpSimd engine cannot access PSUM"):
        nisa.tensor_copy(dst=out((4, 4)), src=out((4, 4), buffer=nl.psum), engine=nisa.engine.gpsimd)


def test_memset_and_predicated_copy():
    dst = out((4, 6))
    nisa.memset(dst=dst, value=2.5)
    assert (dst.values() == 2.5).all()
    pred = filled(torch.tensor([[1, 0, 1, 0, 0, 1]] * 4), nl.uint8)
    nisa.tensor_copy_predicated(dst=dst, src=filled(torch.ones(4, 6)), predicate=pred)
    assert torch.equal(dst.values(), torch.tensor([[1, 2.5, 1, 2.5, 2.5, 1]] * 4))
    nisa.tensor_copy_predicated(dst=dst, src=-1.0, predicate=pred, reverse_pred=True)
    assert torch.equal(dst.values(), torch.tensor([[1, -1, 1, -1, -1, 1.0]] * 4))
    with pytest.raises(nisa.NkiValidationError, match="predicate must be uint8, uint16 or uint32"):
        nisa.tensor_copy_predicated(dst=dst, src=1.0, predicate=filled(torch.ones(4, 6)))


# --- Tensor Engine -------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [nl.float32, nl.bfloat16, nl.float16, nl.float8_e5m2, nl.float8_e4m3])
def test_nc_matmul_is_stationary_transposed_times_moving_in_float32(dtype):
    a, b = rand(128, 96), rand(128, 512)
    sa, sb = filled(a, dtype), filled(b, dtype)
    res = out((96, 512), buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=sa, moving=sb)
    ref = sa.values().t() @ sb.values()
    torch.testing.assert_close(res.values(), ref, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulates_in_psum_until_the_result_is_read():
    a, b = rand(256, 64), rand(256, 128)
    res = out((64, 128), buffer=nl.psum)
    for k in range(2):  # accumulate=None: the first overwrites the NaN-filled PSUM, the second adds
        nisa.nc_matmul(dst=res, stationary=filled(a[k * 128:(k + 1) * 128]), moving=filled(b[k * 128:(k + 1) * 128]))
    evicted = out((64, 128))
    nisa.tensor_copy(dst=evicted, src=res)
    torch.testing.assert_close(evicted.values(), a.t() @ b, rtol=1e-5, atol=1e-4)
    nisa.nc_matmul(dst=res, stationary=filled(a[:128]), moving=filled(b[:128]))  # read: a new group
    torch.testing.assert_close(res.values(), a[:128].t() @ b[:128], rtol=1e-5, atol=1e-4)
    nisa.nc_matmul(dst=res, stationary=filled(a[:128]), moving=filled(b[:128]), accumulate=False)
    nisa.nc_matmul(dst=res, stationary=filled(a[128:]), moving=filled(b[128:]), accumulate=True)
    torch.testing.assert_close(res.values(), a.t() @ b, rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulating_onto_unwritten_psum_gives_nan():
    res = out((8, 8), buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=filled(rand(4, 8)), moving=filled(rand(4, 8)), accumulate=True)
    assert torch.isnan(res.values()).all()


@pytest.mark.parametrize("stationary, moving, dst, message", [
    ((129, 8), (129, 8), (8, 8), "partition dimension 129 exceeds maximum 128"),
    ((128, 129), (128, 8), (129, 8), "stationary free size 129 exceeds maximum 128"),
    ((128, 8), (128, 513), (8, 513), "moving free size 513 exceeds maximum 512 on trn2"),
    ((64, 8), (32, 8), (8, 8), "same partition"),
    ((64, 8), (64, 16), (8, 8), "dst must be 8 x 16"),
])
def test_nc_matmul_tile_limits(stationary, moving, dst, message):
    with pytest.raises(nisa.NkiValidationError, match=message):
        nisa.nc_matmul(dst=out(dst, buffer=nl.psum), stationary=out(stationary), moving=out(moving))


def test_nc_matmul_reads_sbuf_writes_psum_and_pairs_float32_with_float32():
    with pytest.raises(nisa.NkiValidationError, match="nc_matmul dst must be in nl.psum"):
        nisa.nc_matmul(dst=out((8, 8)), stationary=out((4, 8)), moving=out((4, 8)))
    with pytest.raises(nisa.NkiValidationError, match="float32/tfloat32 the other must be too"):
        nisa.nc_matmul(dst=out((8, 8), buffer=nl.psum), stationary=out((4, 8)), moving=out((4, 8), nl.bfloat16))
    with pytest.raises(nisa.NkiValidationError, match="float8_e4m3fn is not supported on trn2"):
        nisa.nc_matmul(dst=out((8, 8), buffer=nl.psum), stationary=out((4, 8), nl.float8_e4m3fn),
                       moving=out((4, 8), nl.float8_e4m3fn))


def test_nc_matmul_double_row_contracts_the_pair_dimension_too():
    a, b = rand(128, 2, 16), rand(128, 2, 32)
    sa, sb = filled(a, nl.float8_e5m2), filled(b, nl.float8_e5m2)
    res = out((16, 32), buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=sa, moving=sb, perf_mode=nisa.matmul_perf_mode.double_row)
    ref = sa.values().reshape(256, 16).t() @ sb.values().reshape(256, 32)
    torch.testing.assert_close(res.values(), ref, rtol=1e-5, atol=1e-4)


def test_nc_transpose_swaps_partitions_and_free_on_tensor_and_vector_engines():
    x = rand(64, 128)
    res = out((128, 64), buffer=nl.psum)
    nisa.nc_transpose(dst=res, data=filled(x))
    assert torch.equal(res.values(), x.t())
    small = out((32, 16))
    nisa.nc_transpose(dst=small, data=filled(x[:16, :32]), engine=nisa.engine.vector)
    assert torch.equal(small.values(), x[:16, :32].t())
    with pytest.raises(nisa.NkiValidationError, match=r"up to \[32, 32\]"):
        nisa.nc_transpose(dst=out((64, 16)), data=filled(x[:16, :64]), engine=nisa.engine.vector)


# --- Vector / Scalar / GpSimd ---------------------------------------------------------------------------
@pytest.mark.parametrize("op, ref", [
    (nl.add, torch.add), (nl.subtract, torch.sub), (nl.multiply, torch.mul), (nl.maximum, torch.maximum),
    (nl.minimum, torch.minimum), (nl.divide, torch.div),
    (nl.greater, lambda a, b: (a > b).float()), (nl.equal, lambda a, b: (a == b).float()),
])
def test_tensor_tensor_arithmetic_in_float32(op, ref):
    a, b = rand(128, 64), rand(128, 64)
    dst = out((128, 64), nl.bfloat16)
    nisa.tensor_tensor(dst=dst, data1=filled(a), data2=filled(b), op=op)
    assert torch.equal(dst.values(), ref(a, b).bfloat16().float())


def test_tensor_tensor_bitvec_operators_act_on_bit_patterns():
    a = torch.randint(0, 2**20, (4, 8), generator=g, dtype=torch.int32)
    b = torch.randint(0, 2**20, (4, 8), generator=g, dtype=torch.int32)
    dst = out((4, 8), nl.int32)
    nisa.tensor_tensor(dst=dst, data1=filled(a, nl.int32), data2=filled(b, nl.int32), op=nl.bitwise_xor)
    assert torch.equal(dst.values(), a ^ b)
    with pytest.raises(nisa.NkiValidationError, match="bitvec operator needs integer tiles"):
        nisa.tensor_tensor(dst=out((4, 8)), data1=out((4, 8)), data2=out((4, 8)), op=nl.bitwise_and)


def test_tensor_tensor_checks_partitions_layout_and_psum():
    with pytest.raises(nisa.NkiValidationError, match="tensor_tensor data1 partition dimension 256 exceeds maximum 128"):
        t = out((256, 8))
        nisa.tensor_tensor(dst=t, data1=t, data2=t, op=nl.add)
    with pytest.raises(nisa.NkiValidationError, match="same partition size and elements per partition"):
        nisa.tensor_tensor(dst=out((8, 8)), data1=out((8, 8)), data2=out((8, 4)), op=nl.add)
    with pytest.raises(nisa.NkiValidationError, match="cannot both be in PSUM"):
        nisa.tensor_tensor(dst=out((8, 8)), data1=out((8, 8), buffer=nl.psum), data2=out((8, 8), buffer=nl.psum),
                           op=nl.add)


def test_tensor_scalar_applies_two_operators_with_column_operands_and_reversal():
    x, col = rand(16, 32), rand(16, 1)
    dst = out((16, 32))
    nisa.tensor_scalar(dst=dst, data=filled(x), op0=nl.subtract, operand0=filled(col), reverse0=True,
                       op1=nl.multiply, operand1=3.0)
    assert torch.equal(dst.values(), (col - x) * 3.0)
    with pytest.raises(nisa.NkiValidationError, match=r"operand0 must be a scalar or a \(16, 1\) tile"):
        nisa.tensor_scalar(dst=dst, data=filled(x), op0=nl.add, operand0=out((16, 2)))


def test_scalar_tensor_tensor_and_reciprocal():
    x, y, col = rand(8, 16), rand(8, 16), rand(8, 1)
    dst = out((8, 16))
    nisa.scalar_tensor_tensor(dst=dst, data=filled(x), op0=nl.multiply, operand0=filled(col), op1=nl.add,
                              operand1=filled(y))
    assert torch.equal(dst.values(), x * col + y)
    nisa.reciprocal(dst=dst, data=filled(x))
    assert torch.equal(dst.values(), 1 / x)


@pytest.mark.parametrize("op, ref", [(nl.exp, torch.exp), (nl.tanh, torch.tanh), (nl.silu, torch.nn.functional.silu),
                                     (nl.gelu, torch.nn.functional.gelu), (nl.rsqrt, torch.rsqrt),
                                     (nl.sigmoid, torch.sigmoid), (nl.copy, lambda v: v)])
def test_activation_computes_op_of_scale_times_data_plus_bias(op, ref):
    x, bias = rand(32, 64).abs() + 0.1, rand(32, 1).abs()
    dst = out((32, 64))
    nisa.activation(dst=dst, op=op, data=filled(x), bias=filled(bias), scale=0.5)
    torch.testing.assert_close(dst.values(), ref(x * 0.5 + bias), rtol=0, atol=0)


def test_activation_reduces_into_its_registers_across_instructions():
    a, b = rand(16, 32), rand(16, 32)
    total = out((16, 1))
    nisa.activation(dst=out((16, 32)), op=nl.exp, data=filled(a), reduce_op=nl.add,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.activation(dst=out((16, 32)), op=nl.exp, data=filled(b), reduce_op=nl.add, reduce_res=total,
                    reduce_cmd=nisa.reduce_cmd.reduce)
    torch.testing.assert_close(total.values(), (a.exp().sum(1) + b.exp().sum(1)).unsqueeze(1))
    only = out((16, 1))
    nisa.activation_reduce(dst=out((16, 32)), op=nl.exp, data=filled(b), reduce_op=nl.add, reduce_res=only)
    torch.testing.assert_close(only.values(), b.exp().sum(1, keepdim=True))


def test_activation_rejects_an_alu_only_operator():
    with pytest.raises(nisa.NkiValidationError, match="not an activation function"):
        nisa.activation(dst=out((4, 4)), op=nl.add, data=out((4, 4)))


@pytest.mark.parametrize("op, ref", [(nl.add, lambda v, d: v.sum(d)), (nl.maximum, lambda v, d: v.amax(d)),
                                     (nl.minimum, lambda v, d: v.amin(d)), (nl.multiply, lambda v, d: v.prod(d))])
def test_tensor_reduce_over_the_last_free_axes(op, ref):
    x = rand(16, 4, 8)
    dst = out((16, 4))
    nisa.tensor_reduce(dst=dst, op=op, data=filled(x), axis=2)
    torch.testing.assert_close(dst.values(), ref(x, 2))
    both = out((16, 1))
    nisa.tensor_reduce(dst=both, op=op, data=filled(x), axis=(1, 2), negate=True)
    torch.testing.assert_close(both.values(), -ref(x.reshape(16, 32), 1).unsqueeze(1))


def test_tensor_reduce_refuses_the_partition_axis_and_inner_axes():
    with pytest.raises(nisa.NkiValidationError, match="cannot reduce axis 0"):
        nisa.tensor_reduce(dst=out((1, 8)), op=nl.add, data=out((16, 8)), axis=0)
    with pytest.raises(nisa.NkiValidationError, match="last contiguous free dims"):
        nisa.tensor_reduce(dst=out((16, 8)), op=nl.add, data=out((16, 4, 8)), axis=1)


def test_tensor_scalar_reduce_accumulates_on_the_vector_engine():
    x = rand(8, 32)
    dst, res = out((8, 32)), out((8, 1))
    nisa.tensor_scalar_reduce(dst=dst, data=filled(x), op0=nl.multiply, operand0=2.0, reduce_op=nl.maximum,
                              reduce_res=res)
    assert torch.equal(dst.values(), x * 2) and torch.equal(res.values(), (x * 2).amax(1, keepdim=True))


def test_iota_and_affine_select_build_a_causal_mask():
    idx = out((4, 6), nl.int32)
    nisa.iota(dst=idx, pattern=[[1, 6]], offset=1, channel_multiplier=10)
    assert torch.equal(idx.values(), torch.arange(6).reshape(1, 6) + 1 + 10 * torch.arange(4).reshape(4, 1))
    scores = rand(4, 6)
    masked = out((4, 6))
    # keep column j of row p where p - j >= 0
    nisa.affine_select(dst=masked, pattern=[[-1, 6]], channel_multiplier=1, on_true_tile=filled(scores),
                       on_false_value=-1e9, cmp_op=nl.greater_equal)
    expect = torch.where(torch.ones(4, 6).tril().bool(), scores, torch.tensor(-1e9))
    assert torch.equal(masked.values(), expect)
    with pytest.raises(nisa.NkiValidationError, match="describes 5 elements per partition, the tile has 6"):
        nisa.iota(dst=idx, pattern=[[1, 5]])


def test_range_select_keeps_indices_between_bounds_and_reduces_their_max():
    x = rand(4, 16)
    lo, hi = filled(torch.tensor([[0.0], [2.0], [4.0], [6.0]])), filled(torch.tensor([[3.0], [5.0], [9.0], [16.0]]))
    dst, mx = out((4, 16)), out((4, 1))
    nisa.range_select(dst=dst, on_true_tile=filled(x), comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=lo,
                      bound1=hi, reduce_res=mx)
    j = torch.arange(16.0).reshape(1, 16)
    keep = (j >= lo.values()) & (j < hi.values())
    expect = torch.where(keep, x, torch.tensor(-3.4028235e38))
    assert torch.equal(dst.values(), expect) and torch.equal(mx.values(), expect.amax(1, keepdim=True))


def test_bn_stats_and_bn_aggr_give_mean_and_population_variance():
    x = rand(16, 1000)
    stats = out((16, 12))
    nisa.bn_stats(dst=stats[:, 0:6], data=filled(x[:, :500]))
    nisa.bn_stats(dst=stats[:, 6:12], data=filled(x[:, 500:]))
    mv = out((16, 2))
    nisa.bn_aggr(dst=mv, data=stats)
    torch.testing.assert_close(mv.values(), torch.stack([x.mean(1), x.var(1, unbiased=False)], 1))
    with pytest.raises(nisa.NkiValidationError, match="512"):
        nisa.bn_stats(dst=out((16, 6)), data=filled(x[:, :513]))


def test_registers_load_store_and_drive_dynamic_loops():
    count = filled(torch.tensor([[3]]), nl.int32)
    reg = nisa.register_alloc()
    nisa.register_load(reg, count)
    assert [int(i) for i in nl.dynamic_range(reg)] == [0, 1, 2]
    back = out((1, 1), nl.int32)
    nisa.register_store(back, reg)
    assert back.values().item() == 3


# --- scans, search, shuffles (isa_scan.py, isa_search.py) ---------------------------------------------
def test_tensor_tensor_scan_runs_a_linear_recurrence_along_the_free_dim():
    a, b, init = rand(8, 20), rand(8, 20), rand(8, 1)
    dst = out((8, 20))
    nisa.tensor_tensor_scan(dst=dst, data0=filled(a), data1=filled(b), initial=filled(init), op0=nl.multiply,
                            op1=nl.add)
    state, expect = init[:, 0], []
    for i in range(20):
        state = a[:, i] * state + b[:, i]
        expect.append(state)
    assert torch.equal(dst.values(), torch.stack(expect, 1))


def test_tensor_scalar_cumulative_is_a_running_reduction():
    x = rand(4, 10)
    dst = out((4, 10))
    nisa.tensor_scalar_cumulative(dst=dst, src=filled(x), op0=nl.multiply, op1=nl.add, imm0=2.0)
    torch.testing.assert_close(dst.values(), torch.cumsum(2 * x, 1))
    nisa.tensor_scalar_cumulative(dst=dst, src=filled(x), op0=nl.add, op1=nl.maximum, imm0=0.0)
    assert torch.equal(dst.values(), torch.cummax(x, 1).values)


def test_max8_and_nc_find_index8_find_the_largest_values_and_where_they_are():
    x = rand(16, 100)
    top = out((16, 8))
    nisa.max8(dst=top, src=filled(x))
    assert torch.equal(top.values(), x.topk(8, 1).values)
    idx = out((16, 8), nl.uint32)
    nisa.nc_find_index8(dst=idx, data=filled(x), vals=top)
    assert torch.equal(idx.values(), x.topk(8, 1).indices)


def test_nc_match_replace8_pairs_duplicates_as_the_isa_docs_example():
    data = filled(torch.tensor([[1.0, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]]))
    vals = filled(torch.tensor([[3.0, 8, 8, 8, 8, 8, 8, 8]]))
    dst, idx = out((1, 11)), out((1, 8), nl.uint32)
    nisa.nc_match_replace8(dst=dst, data=data, vals=vals, imm=-1.0, dst_idx=idx)
    assert idx.values().tolist() == [[2, 10, 9, 8, 7, 6, 5, 4]]
    assert dst.values().tolist() == [[1.0, 2, -1, 4, -1, -1, -1, -1, -1, -1, -1]]


def test_nonzero_with_count_works_on_each_gpsimd_cores_first_partition():
    x = torch.zeros(32, 8)
    x[0] = torch.tensor([0, 1, 1, 0, 0, 1, 0, 0.0])
    x[16, 7] = 5.0
    x[1] = 1.0  # not a core's first partition: neither read nor written
    dst = out((32, 9), nl.int32)
    nisa.memset(dst=dst, value=0)
    nisa.nonzero_with_count(dst=dst, src=filled(x), index_offset=16, padding_val=-1)
    v = dst.values()
    assert v[0].tolist() == [17, 18, 21, -1, -1, -1, -1, -1, 3]
    assert v[16].tolist() == [23, -1, -1, -1, -1, -1, -1, -1, 1]
    assert (v[1] == 0).all()


def test_nc_n_gather_gathers_within_each_partition():
    x = rand(8, 4, 5)
    idx = torch.randint(0, 20, (8, 7), generator=g)
    dst = out((8, 7))
    nisa.nc_n_gather(dst=dst, data=filled(x), indices=filled(idx, nl.uint32))
    assert torch.equal(dst.values(), torch.gather(x.reshape(8, 20), 1, idx))
    with pytest.raises(nisa.NkiValidationError, match="outside"):
        nisa.nc_n_gather(dst=dst, data=filled(x), indices=filled(idx + 20, nl.uint32))


@pytest.mark.parametrize("dtype", [nl.uint32, nl.uint16, nl.int32, nl.uint8, nl.bfloat16, nl.float16])
def test_nc_n_gather_moves_the_bits_of_every_dtype(dtype):
    # uint16 and uint32 data once raised torch's "scatter_gather_tensor_cpu not implemented"
    # (issue 38, item 4): elements move by their bits, whatever their dtype
    x = torch.randint(0, 200, (8, 20), generator=g)
    idx = torch.randint(0, 20, (8, 7), generator=g)
    dst = out((8, 7), dtype)
    nisa.nc_n_gather(dst=dst, data=filled(x, dtype), indices=filled(idx, nl.uint32))
    assert torch.equal(dst.values(), torch.gather(x, 1, idx).float())


def test_dma_copy_scatters_uint32_rows_by_a_vector_offset():
    data = torch.randint(0, 2**31, (4, 8), generator=g)
    idx = filled(torch.tensor([[3], [0], [15], [7]]), nl.uint32)
    target = filled(torch.zeros(16, 8), nl.uint32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=target.ap(pattern=[[8, 4], [1, 8]], vector_offset=idx, indirect_dim=0),
                  src=filled(data, nl.uint32))
    expect = torch.zeros(16, 8, dtype=torch.int64)
    expect[[3, 0, 15, 7]] = data
    assert torch.equal(target.torch_view().to(torch.int64), expect)


@nki.jit
def _scatter_into_flattened(table, flat_index, values):
    """The NKI library's router_topk scatter (use_indirect_dma_scatter): one value per token into
    a (T, E) table, at offsets into its T * E elements, through the table's 1-D reshape."""
    T, E = table.shape
    idx = nl.ndarray((T, 1), dtype=nl.uint32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=flat_index)
    vals = nl.ndarray((T, 1), dtype=table.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=vals, src=values)
    flat = table.reshape((T * E,))
    nisa.dma_copy(dst=flat.ap([[1, T], [1, 1]], offset=0, vector_offset=idx, indirect_dim=0), src=vals)
    return table


def test_a_vector_offset_counts_along_the_dim_of_the_view_it_is_given():
    """issue 38, item 2: the runtime offsets index the reshaped (T * E,) view, not the (T, E)
    tensor it was made from (router_topk's 'runtime index 55 is out of bounds [0, 8)')."""
    T, E = 8, 8
    experts = torch.tensor([3, 0, 7, 5, 1, 6, 2, 4])
    flat_index = (torch.arange(T) * E + experts).reshape(T, 1)  # up to 61, past T
    values = torch.arange(1.0, T + 1).reshape(T, 1)
    table = torch.zeros(T, E)
    _scatter_into_flattened(table, flat_index.to(torch.int32), values)
    expect = torch.zeros(T, E)
    expect[torch.arange(T), experts] = values.reshape(-1)
    assert torch.equal(table, expect)


def test_a_view_past_a_tiles_end_raises_only_when_it_is_accessed():
    """The simulator checks accesses, not views (issue 38, item 3): the NKI library's
    output_projection_tkg builds a view past a tile's end and uses it only where an `if` lets it."""
    t = filled(rand(128, 64))
    past = t.ap(pattern=[[64, 128], [1, 64]], offset=32)  # built: no access yet
    with pytest.raises(nisa.NkiValidationError, match="past the end of its storage"):
        nisa.tensor_copy(dst=out((128, 64)), src=past)
    with pytest.raises(nisa.NkiValidationError, match="past the end of its storage"):
        nisa.tensor_copy(dst=past, src=out((128, 64)))


@nki.jit
def _copy_maybe_past_the_end(x, use_past):
    R, C = x.shape
    result = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.sbuf)
    past = x.ap(pattern=[[C, R], [1, C]], offset=C)  # one row too far, read only if asked
    nisa.dma_copy(dst=tile, src=past if use_past else x)
    nisa.dma_copy(dst=result, src=tile)
    return result


def test_a_kernel_may_build_a_view_past_an_arguments_end_that_it_never_reads():
    x = rand(4, 8)
    assert torch.equal(_copy_maybe_past_the_end(x, False), x)
    with pytest.raises(nisa.NkiValidationError, match="past the end of its storage"):
        _copy_maybe_past_the_end(x, True)


def test_nc_stream_shuffle_permutes_partitions_within_each_quadrant():
    x = rand(64, 4)
    mask = list(reversed(range(32)))
    mask[5] = 255  # partition 5 of each quadrant keeps what dst held
    dst = filled(torch.zeros(64, 4))
    nisa.nc_stream_shuffle(dst=dst, src=filled(x), shuffle_mask=mask)
    expect = torch.cat([x[:32].flip(0), x[32:].flip(0)])
    expect[5] = expect[37] = 0.0
    assert torch.equal(dst.values(), expect)


def test_select_reduce_and_tensor_partition_reduce():
    x, pred = rand(8, 16), torch.randint(0, 2, (8, 16), generator=g)
    dst, mx = out((8, 16)), out((8, 1))
    nisa.select_reduce(dst=dst, predicate=filled(pred, nl.uint8), on_true=filled(x), on_false=-5.0, reduce_res=mx,
                       reduce_cmd=nisa.reduce_cmd.reset_reduce)
    expect = torch.where(pred.bool(), x, torch.tensor(-5.0))
    assert torch.equal(dst.values(), expect) and torch.equal(mx.values(), expect.amax(1, keepdim=True))
    total = out((1, 16))
    nisa.tensor_partition_reduce(dst=total, op=nl.add, data=filled(x))
    torch.testing.assert_close(total.values(), x.sum(0, keepdim=True))


def test_exponential_is_a_trn3_vector_instruction(monkeypatch):
    x = rand(4, 8)
    with pytest.raises(nisa.NkiValidationError, match="NeuronCore-v4"):
        nisa.exponential(dst=out((4, 8)), src=filled(x))

    @nki.jit
    def kernel(a):
        t = nl.load(a)
        e, s = nl.ndarray(a.shape, nl.float32, nl.sbuf), nl.ndarray((a.shape[0], 1), nl.float32, nl.sbuf)
        nisa.exponential(dst=e, src=t, max_value=1.0, reduce_res=s, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        out_e = nl.ndarray(a.shape, nl.float32, nl.shared_hbm)
        out_s = nl.ndarray((a.shape[0], 1), nl.float32, nl.shared_hbm)
        nl.store(out_e, e)
        nl.store(out_s, s)
        return out_e, out_s

    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    e, s = kernel(x)
    assert torch.equal(e, torch.exp(x - 1.0)) and torch.allclose(s, torch.exp(x - 1.0).sum(1, keepdim=True))


def test_local_gather_gathers_each_cores_offsets_from_every_partitions_own_row():
    src = rand(32, 64)
    idx = torch.randint(0, 15, (32, 2), generator=g) * 4  # element offsets, 4 elements each
    dst = out((32, 24))
    nisa.local_gather(dst=dst, src_buffer=filled(src), index=filled(idx, nl.uint16), num_elem_per_idx=4,
                      num_valid_indices=6)
    expect = torch.empty(32, 6, 4)
    for c in range(2):
        offsets = idx[16 * c:16 * (c + 1)].t().reshape(-1)[:6]
        for k, o in enumerate(offsets):
            expect[16 * c:16 * (c + 1), k] = src[16 * c:16 * (c + 1), o:o + 4]
    assert torch.equal(dst.values(), expect.reshape(32, 24))


def test_tiles_placed_at_one_address_share_their_bytes():
    a = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 2048))
    b = nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 2048))
    nisa.memset(dst=a, value=3.0)
    assert (b.values() == 3.0).all()
    many = [nl.ndarray((128, 512), nl.float32, buffer=nl.psum, address=(0, 2048 * (i % 8))) for i in range(20)]
    assert len(many) == 20  # placed tiles are the kernel's own business: no bank is charged for them
    with pytest.raises(nisa.NkiValidationError, match="lies outside the psum"):
        nl.ndarray((128, 1024), nl.float32, buffer=nl.psum, address=(0, 14336))


def test_a_placed_tile_keeps_the_logical_partition_stride_of_its_views():
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf, address=(2, 64))
    assert t.strides == (8, 1) and t.get_pattern() == [[8, 4], [1, 8]]
    x = rand(4, 8)
    t.torch_view().copy_(x)
    assert torch.equal(t.ap(pattern=[[8, 4], [2, 4]]).values(), x[:, ::2])
    twin = nl.ndarray((2, 8), nl.float32, buffer=nl.sbuf, address=(3, 64))  # partitions 3-4: t's rows 1-2
    assert torch.equal(twin.values(), x[1:3])


def test_dma_compute_adds_sources_and_scatter_adds_through_a_vector_offset():
    a, b = rand(8, 16), rand(8, 16)
    dst = out((8, 16))
    nisa.dma_compute(dst=dst, srcs=[filled(a), filled(b, buffer=nl.shared_hbm)], reduce_op=nl.add)
    assert torch.equal(dst.values(), a + b)
    table = rand(10, 16)
    hbm = filled(table, buffer=nl.shared_hbm)
    idx = filled(torch.tensor([[7], [2], [9]]), nl.uint32)
    rows = hbm.ap(pattern=[[16, 3], [1, 16]], vector_offset=idx, indirect_dim=0)
    nisa.dma_compute(dst=rows, srcs=[rows, filled(a[:3])], reduce_op=nl.add)
    expect = table.clone()
    expect[[7, 2, 9]] += a[:3]
    assert torch.equal(hbm.values(), expect)
    with pytest.raises(nisa.NkiValidationError, match="only reduce_op=nl.add"):
        nisa.dma_compute(dst=dst, srcs=[filled(a)], reduce_op=nl.maximum)


@nki.jit
def _activate2_cases(x, scale):
    P, F = x.shape
    t, sc = nl.load(x), nl.load(scale)
    results = []
    dst, acc = nl.ndarray((P, F), nl.float32, nl.sbuf), nl.ndarray((P, 1), nl.float32, nl.sbuf)
    nisa.activate2(dst=dst, op=nl.tanh, data=t, imm0=sc, imm1=0.25, op0=nl.multiply, op1=nl.subtract,
                   reduce_op=nl.add, reduce_res=acc, reduce_cmd=nisa.reduce_cmd.reset_reduce)
    results += [dst, acc]
    rev = nl.ndarray((P, F), nl.float32, nl.sbuf)  # imm0 - data
    nisa.activate2(dst=rev, op=nl.copy, data=t, imm0=3.0, imm1=None, op0=nl.subtract, op1=nl.bypass, reverse0=True)
    leaky = nl.ndarray((P, F), nl.float32, nl.sbuf)
    nisa.activate2(dst=leaky, op=nl.prelu, data=t, imm0=None, imm1=None, op0=nl.bypass, op1=nl.bypass,
                   relu_param=0.1)
    on_gpsimd = nl.ndarray((P, F), nl.float32, nl.sbuf)
    nisa.activate2(dst=on_gpsimd, op=nl.exp, data=t, imm0=0.5, imm1=None, op0=nl.multiply, op1=nl.bypass,
                   engine=nisa.engine.gpsimd)
    outs = []
    for r in results + [rev, leaky, on_gpsimd]:
        o = nl.ndarray(r.shape, nl.float32, nl.shared_hbm)
        nl.store(o, r)
        outs.append(o)
    return tuple(outs)


@nki.jit
def _activate2_bad(x, op0, op1, reverse1):
    t = nl.load(x)
    nisa.activate2(dst=nl.ndarray(x.shape, nl.float32, nl.sbuf), op=nl.exp, data=t, imm0=1.0, imm1=1.0, op0=op0,
                   op1=op1, reverse1=reverse1)
    return x


def test_activate2_is_a_trn3_instruction_with_a_tensor_scalar_stage(monkeypatch):
    """issue 38, item 5: (data op0 imm0) op1 imm1, then the activation, then the accumulation."""
    x, scale = rand(4, 8), torch.tensor([[1.0], [2.0], [0.5], [-1.0]])
    with pytest.raises(nisa.NkiValidationError, match="NeuronCore-v4"):
        _activate2_cases(x, scale)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    dst, acc, rev, leaky, on_gpsimd = _activate2_cases(x, scale)
    expect = torch.tanh(x * scale - 0.25)
    torch.testing.assert_close(dst, expect)
    torch.testing.assert_close(acc, expect.sum(1, keepdim=True))
    assert torch.equal(rev, 3.0 - x)
    assert torch.equal(leaky, torch.where(x >= 0, x, x * torch.tensor(0.1)))
    torch.testing.assert_close(on_gpsimd, torch.exp(x * 0.5))
    with pytest.raises(nisa.NkiValidationError, match=r"\('add', 'add'\) is not a tensor-scalar stage"):
        _activate2_bad(x, nl.add, nl.add, False)
    with pytest.raises(nisa.NkiValidationError, match="reverse1 needs op1"):
        _activate2_bad(x, nl.add, nl.bypass, True)


@nki.jit
def _rng_round_trip(seeds):
    """Seed the Vector Engine, draw, read the state, draw again, reseed, draw: (a, b, state, c)."""
    s = nl.ndarray(seeds.shape, nl.uint32, nl.sbuf)
    nisa.dma_copy(dst=s, src=seeds)
    nisa.rand_set_state(src_seeds=s, engine=nisa.engine.vector)
    a = nl.ndarray((4, 16), nl.float32, nl.sbuf)
    nisa.rand2(dst=a, min=-1.0, max=3.0)
    state = nl.ndarray((4, 24), nl.uint32, nl.sbuf)
    nisa.rand_get_state(dst=state, engine=nisa.engine.vector)
    b = nl.ndarray((4, 16), nl.float32, nl.sbuf)
    nisa.rand2(dst=b, min=-1.0, max=3.0)
    nisa.rand_set_state(src_seeds=s, engine=nisa.engine.vector)
    c = nl.ndarray((4, 16), nl.float32, nl.sbuf)
    nisa.rand2(dst=c, min=-1.0, max=3.0)
    outs = []
    for t in (a, b, state, c):
        o = nl.ndarray(t.shape, t.dtype, nl.shared_hbm)
        nl.store(o, t)
        outs.append(o)
    return tuple(outs)


def test_rand2_draws_uniform_values_reproducibly_from_the_vector_engines_state(monkeypatch):
    """issue 38, item 5: rand_set_state / rand_get_state / rand2 (XORWOW per lane)."""
    seeds = torch.randint(1, 2**32, (4, 24), generator=g).to(torch.uint32)
    with pytest.raises(nisa.NkiValidationError, match="NeuronCore-v4|GpSimd Engine"):
        _rng_round_trip(seeds)
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    a, b, state, c = _rng_round_trip(seeds)
    assert torch.equal(a, c)  # the same seeds, the same numbers
    assert not torch.equal(a, b)  # the state moved on
    assert bool(((a >= -1.0) & (a <= 3.0)).all()) and a.std() > 0.5
    assert not torch.equal(state.to(torch.int64), seeds.to(torch.int64))  # read after the first draws
    assert len(set(a.reshape(-1).tolist())) == a.numel()  # lanes and elements differ


def test_rng_state_holds_six_words_per_lane_on_gpsimd_and_refuses_other_sizes():
    @nki.jit
    def round_trip(seeds):
        s = nl.ndarray(seeds.shape, nl.uint32, nl.sbuf)
        nisa.dma_copy(dst=s, src=seeds)
        nisa.rand_set_state(src_seeds=s, engine=nisa.engine.gpsimd)
        back = nl.ndarray(seeds.shape, nl.uint32, nl.sbuf)
        nisa.rand_get_state(dst=back, engine=nisa.engine.gpsimd)
        out = nl.ndarray(seeds.shape, nl.uint32, nl.shared_hbm)
        nl.store(out, back)
        return out

    seeds = torch.randint(1, 2**32, (8, 6), generator=g).to(torch.uint32)  # every bit of every word
    assert torch.equal(round_trip(seeds).to(torch.int64), seeds.to(torch.int64))
    with pytest.raises(nisa.NkiValidationError, match="6 XORWOW words per lane on the GpSimd Engine, got 24"):
        round_trip(torch.randint(1, 2**32, (8, 24), generator=g).to(torch.uint32))
