"""The neuronxcc.nki dialect (NKI 0.1) on the emulated NeuronCore: the forms of nki-samples, the
SDK's older tutorials and TorchNeuron's NKI tests, and the new toolchain's refusals of them.

Each kernel here is our own, written in the old dialect's style: Python operators on tiles,
`nl.arange`/`nl.mgrid` indices, `mask=`, `nl.par_dim`, grids given as lists, `nki.jit(mode=...)`,
`nki.benchmark`, `nki.simulate_kernel`.
"""
from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import pytest
import torch

import adaptive_eager.nki as new_nki
import adaptive_eager.nki.language as new_nl
import adaptive_eager.nki.neuronxcc as nki
import adaptive_eager.nki.neuronxcc.isa as nisa
import adaptive_eager.nki.neuronxcc.language as nl
import adaptive_eager.nki.neuronxcc.typing as nt
from adaptive_eager.device.nki.errors import NkiValidationError


def rand(*shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- install_neuronxcc(): `from neuronxcc import nki`, never over a real one ---------------------------
def test_install_neuronxcc_makes_the_neuronxcc_imports_the_emulator_and_uninstall_removes_them():
    new_nki.install_neuronxcc()
    try:
        assert importlib.import_module("neuronxcc").nki is nki
        assert importlib.import_module("neuronxcc.nki") is nki
        assert importlib.import_module("neuronxcc.nki.language") is nl
        assert importlib.import_module("neuronxcc.nki.isa") is nki.isa
        assert importlib.import_module("neuronxcc.nki.typing") is nt
        from neuronxcc import nki as imported
        assert imported is nki
    finally:
        new_nki.uninstall()
    assert "neuronxcc" not in sys.modules and "neuronxcc.nki" not in sys.modules


def test_install_neuronxcc_refuses_to_shadow_a_real_neuronxcc(monkeypatch):
    monkeypatch.setitem(sys.modules, "neuronxcc", types.ModuleType("neuronxcc"))
    with pytest.raises(RuntimeError, match="a real 'neuronxcc' package is installed.*never shadows it"):
        new_nki.install_neuronxcc()


# --- operators on tiles: the old dialect's, a TypeError in nki -----------------------------------------
@nki.jit
def scale_shift_kernel(a_input, b_input):
    out = nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
    a = nl.load(a_input)
    b = nl.load(b_input)
    c = (a * 2.0 + b) / (1.0 - -b) - a ** 2
    nl.store(out, value=c)
    return out


def test_python_operators_on_tiles_compute_what_the_nl_functions_do():
    a, b = rand(128, 64), np.abs(rand(128, 64, seed=1))
    out = scale_shift_kernel(a, b)
    np.testing.assert_allclose(out, (a * 2.0 + b) / (1.0 + b) - a ** 2, rtol=1e-5, atol=1e-5)


def test_operators_on_tiles_are_a_type_error_in_an_nki_kernel_as_in_the_new_toolchain():
    @new_nki.jit
    def kernel(a_input):
        out = new_nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=new_nl.shared_hbm)
        new_nl.store(out, new_nl.load(a_input) * 2.0)
        return out

    with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for \*: 'NkiTensor' and 'float'"):
        kernel(rand(128, 64))


# --- nl.arange / nl.mgrid indices and grids given as lists -------------------------------------------------
@nki.jit
def tiled_add_kernel(a_input, b_input):
    out = nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
    ix = nl.program_id(0) * 128 + nl.arange(128)[:, None]
    iy = nl.program_id(1) * 256 + nl.arange(256)[None, :]
    nl.store(out[ix, iy], value=nl.load(a_input[ix, iy]) + nl.load(b_input[ix, iy]))
    return out


def test_arange_indices_address_each_programs_tile_of_a_grid_given_as_a_list():
    a, b = rand(256, 512, dtype=np.float16), rand(256, 512, dtype=np.float16, seed=1)
    out = tiled_add_kernel[[2, 2]](a, b)
    np.testing.assert_array_equal(out, a + b)
    np.testing.assert_array_equal(tiled_add_kernel[nl.spmd_dim(2, nl.nc(1)), 2](a, b), a + b)


def test_a_grid_given_as_a_list_is_refused_by_nki_jit():
    kernel = new_nki.jit(lambda a: a)
    with pytest.raises(TypeError, match=r"kernel\[...\] takes the grid as ints"):
        kernel[[2, 2]]


@nki.jit
def transpose_within_partitions_kernel(in_tensor, rows: int, cols: int):
    out = nl.ndarray(in_tensor.shape, dtype=in_tensor.dtype, buffer=nl.shared_hbm)
    tile = nl.load(in_tensor)
    i_p, i_r, i_c = nl.mgrid[0:in_tensor.shape[0], 0:rows, 0:cols]
    moved = nl.ndarray((nl.par_dim(in_tensor.shape[0]), rows * cols), dtype=in_tensor.dtype)
    moved[i_p, i_c * rows + i_r] = nl.copy(tile[i_p, i_r * cols + i_c])
    nl.store(out, value=moved)
    return out


def test_affine_index_expressions_move_elements_within_each_partition():
    a = np.arange(5 * 12, dtype=np.int32).reshape(5, 12)
    out = transpose_within_partitions_kernel(a, 3, 4)
    np.testing.assert_array_equal(out, a.reshape(5, 3, 4).transpose(0, 2, 1).reshape(5, 12))


def test_an_index_across_partitions_of_an_on_chip_tile_is_refused():
    @nki.jit
    def kernel(a_input):
        tile = nl.load(a_input)
        i_p, i_f = nl.mgrid[0:8, 0:8]
        nl.copy(tile[i_f, i_p])

    with pytest.raises(NkiValidationError, match="partition dim .dim 0. must be indexed by the result's first dim"):
        kernel(rand(8, 8))


# --- mask= --------------------------------------------------------------------------------------------
@nki.jit
def masked_row_softmax_kernel(a_tensor):
    out = nl.ndarray(a_tensor.shape, dtype=a_tensor.dtype, buffer=nl.shared_hbm)
    ix = nl.arange(128)[:, None]
    iy = nl.arange(a_tensor.shape[1])[None, :]
    rows = a_tensor.shape[0]
    for i in nl.affine_range((rows + 127) // 128):
        tile = nl.load(a_tensor[i * 128 + ix, iy], mask=(i * 128 + ix < rows))
        peak = nl.max(tile, axis=[1], keepdims=True, mask=(i * 128 + ix < rows))
        e = nl.exp(nl.subtract(tile, peak, mask=(i * 128 + ix < rows)))
        nl.store(out[i * 128 + ix, iy], value=e / nl.sum(e, axis=[1]), mask=(i * 128 + ix < rows))
    return out


def test_a_mask_keeps_loads_math_and_stores_inside_a_tensor_whose_rows_do_not_fill_the_tiles():
    a = rand(200, 64)
    out = masked_row_softmax_kernel(a)
    np.testing.assert_allclose(out, torch.softmax(torch.from_numpy(a), dim=1).numpy(), rtol=1e-5, atol=1e-6)


@nki.jit
def masked_square_kernel(in_tensor):
    out = nl.ndarray((64, 256), dtype=in_tensor.dtype, buffer=nl.shared_hbm)
    i_p = nl.arange(128)[:, None]
    i_f = nl.arange(512)[None, :]
    tile = nl.load(in_tensor[i_p, i_f])
    squared = nl.square(tile, mask=((i_p < 64) & (i_f < 256)))
    nl.store(out[i_p, i_f], squared[i_p, i_f], mask=((i_p < 64) & (i_f < 256)))
    return out


def test_a_mask_of_two_bounds_computes_and_stores_the_corner_it_keeps():
    a = rand(128, 512)
    np.testing.assert_allclose(masked_square_kernel(a), np.square(a[:64, :256]), rtol=1e-6)


def test_an_index_past_a_tensors_end_without_a_mask_raises_naming_the_dim_and_the_fix():
    @nki.jit
    def kernel(a_input):
        out = nl.ndarray((128, 64), dtype=a_input.dtype, buffer=nl.shared_hbm)
        nl.store(out, nl.load(a_input[nl.arange(128)[:, None], nl.arange(64)[None, :]]))
        return out

    with pytest.raises(NkiValidationError, match=r"index of dim 0 .* reaches \[0, 127\], outside \[0, 100\).*mask="):
        kernel(rand(100, 64))


# --- nl.par_dim and block dimensions ---------------------------------------------------------------
@nki.jit
def blocked_row_sums_kernel(a_input):
    """Loads all row tiles into one block tensor first, then reduces each (nki-samples' style)."""
    n_tiles = a_input.shape[0] // 128
    out = nl.ndarray((a_input.shape[0], 1), dtype=a_input.dtype, buffer=nl.shared_hbm)
    tiles = nl.ndarray((n_tiles, nl.par_dim(128), a_input.shape[1]), dtype=a_input.dtype, buffer=nl.sbuf)
    i_p, i_f = nl.mgrid[0:128, 0:a_input.shape[1]]
    for t in nl.affine_range(n_tiles):
        tiles[t, i_p, i_f] = nl.load(a_input[t * 128 + i_p, i_f])
    for t in nl.affine_range(n_tiles):
        nl.store(out[t * 128:(t + 1) * 128, :], nl.sum(tiles[t], axis=[1]))
    return out


def test_block_dimensions_before_par_dim_are_a_list_of_tiles_indexed_by_block_first():
    a = rand(384, 64)
    np.testing.assert_allclose(blocked_row_sums_kernel(a), a.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-5)


def test_a_block_tensor_indexed_across_blocks_raises_naming_the_fix():
    @nki.jit
    def kernel(a_input):
        tiles = nl.ndarray((2, nl.par_dim(128), 64), dtype=a_input.dtype, buffer=nl.sbuf)
        nl.load(a_input)  # a tile, then a view across the block dim, which is no tile
        return tiles[0:2, 0]

    with pytest.raises(NkiValidationError, match=r"index its block dims with ints first"):
        kernel(rand(128, 64))


# --- the old nki.tensor's methods, reductions over any free axes, 1-D loads --------------------------------
@nki.jit
def window_mean_kernel(in_tensor, pool: int):
    """Average pooling over (pool x pool) windows of each partition's (H, W) image."""
    p, h, w = in_tensor.shape
    out = nl.ndarray((p, h // pool, w // pool), dtype=in_tensor.dtype, buffer=nl.shared_hbm)
    i0, i1, i2, i3, i4 = nl.mgrid[0:p, 0:h // pool, 0:pool, 0:w // pool, 0:pool]
    tile = nl.load(in_tensor)
    sums = nl.sum(tile[i0, pool * i1 + i2, pool * i3 + i4], axis=[2, 4])
    nl.store(out, value=sums.astype(nl.float32) / (pool * pool))
    return out


def test_a_reduction_over_free_axes_that_are_not_the_last_moves_them_by_a_view():
    a = rand(4, 6, 8)
    np.testing.assert_allclose(window_mean_kernel(a, 2), a.reshape(4, 3, 2, 4, 2).mean(axis=(2, 4)), rtol=1e-5,
                               atol=1e-6)


@nki.jit
def column_scale_kernel(a_input, column_scale):
    out = nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
    scale = nl.load(column_scale)  # 1-D: a column of one value per partition
    row = nl.load(column_scale.reshape((1, a_input.shape[0])))
    assert scale.shape == (a_input.shape[0], 1) and row.itemsize == 4
    wide = row.broadcast_to((a_input.shape[0], a_input.shape[0]))
    nl.store(out, value=nl.load(a_input) * scale + wide.assert_shape((a_input.shape[0], a_input.shape[0])))
    return out


def test_a_1d_load_is_a_column_and_tiles_have_the_old_tensor_methods():
    a, s = rand(64, 64), rand(64, seed=1)
    np.testing.assert_allclose(column_scale_kernel(a, s), a * s[:, None] + s[None, :], rtol=1e-5, atol=1e-6)


def test_the_old_tensor_methods_do_not_exist_on_an_nki_kernels_tiles():
    @new_nki.jit
    def kernel(a_input):
        return new_nl.load(a_input).broadcast_to((128, 64))

    with pytest.raises(AttributeError, match="'NkiTensor' object has no attribute 'broadcast_to'"):
        kernel(rand(1, 64))


# --- instructions that return their result tile ------------------------------------------------------
@nki.jit
def accumulating_matmul_kernel(lhsT, rhs):
    K, M = lhsT.shape
    result = nl.ndarray((M, rhs.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    res_psum = nl.zeros((M, rhs.shape[1]), nl.float32, buffer=nl.psum)
    for k in nl.affine_range(K // 128):
        lhs_tile = nl.load(lhsT[k * 128:(k + 1) * 128, :])
        rhs_tile = nl.load(rhs[k * 128:(k + 1) * 128, :])
        res_psum += nisa.nc_matmul(lhs_tile, rhs_tile)
    scaled = nisa.tensor_scalar(res_psum, np.multiply, 0.5, op1=np.add, operand1=1.0)
    row_max = nisa.tensor_reduce(np.max, scaled, axis=(1,), keepdims=True)
    nl.store(result, value=nisa.activation(op=nl.exp, data=scaled, bias=nisa.tensor_copy(row_max) * -1.0))
    return result


def test_old_instructions_return_their_tile_and_plus_equals_accumulates_into_psum():
    lhsT, rhs = rand(256, 64), rand(256, 96, seed=1)
    scaled = (lhsT.T.astype(np.float64) @ rhs) * 0.5 + 1.0
    expected = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    np.testing.assert_allclose(accumulating_matmul_kernel(lhsT, rhs), expected, rtol=1e-4, atol=1e-5)


def test_plus_equals_on_a_tile_is_a_type_error_in_an_nki_kernel():
    @new_nki.jit
    def kernel(a_input):
        tile = new_nl.load(a_input)
        tile += tile

    with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for \+="):
        kernel(rand(128, 64))


@nki.jit
def gather_every_other_row_kernel(data_tensor):
    out = nl.ndarray((64, data_tensor.shape[1]), dtype=data_tensor.dtype, buffer=nl.shared_hbm)
    grid = nl.mgrid[0:64, 0:data_tensor.shape[1]]
    rows = nisa.iota(2 * nl.arange(64)[:, None] + 1, dtype=np.int32)
    nl.store(out[grid.p, grid.x], value=nl.load(data_tensor[rows, grid.x]))
    return out


def test_iota_of_an_index_expression_and_an_index_tile_gather_rows():
    a = rand(128, 32)
    np.testing.assert_array_equal(gather_every_other_row_kernel(a), a[1::2])


@nki.jit
def transposed_prefix_sum_kernel(a_input):
    """Loads a transposed (in bfloat16), then scans each partition: r[i] = 1 * r[i-1] + x[i]."""
    out = nl.ndarray((a_input.shape[1], a_input.shape[0]), dtype=nl.float32, buffer=nl.shared_hbm)
    xt = nl.load_transpose2d(a_input, dtype=nl.bfloat16)
    ones = nl.full(xt.shape, 1.0, dtype=nl.float32)
    nl.store(out, value=nisa.tensor_tensor_scan(ones, xt, initial=0.0, op0=np.multiply, op1=np.add,
                                                dtype=nl.float32))
    return out


def test_load_transpose2d_casts_and_tensor_tensor_scan_returns_its_tile():
    a = rand(32, 16)
    expected = np.cumsum(torch.from_numpy(a.T).to(torch.bfloat16).float().numpy(), axis=1)
    np.testing.assert_allclose(transposed_prefix_sum_kernel(a), expected, rtol=1e-5, atol=1e-5)


@nki.jit(mode="simulation")
def exp_blocks_kernel(a_ptr):
    """The SDK docs' memory-semantics example: par_dim in an HBM shape marks nothing."""
    B, N, M = a_ptr.shape
    loaded = nl.ndarray((B, nl.par_dim(N), M), dtype=a_ptr.dtype, buffer=nl.sbuf)
    out_ptr = nl.ndarray((B, nl.par_dim(N), M), dtype=a_ptr.dtype, buffer=nl.shared_hbm)
    for b in nl.affine_range(B):
        loaded[b] = nl.load(a_ptr[b])
        nl.store(out_ptr[b], value=nl.exp(loaded[b]))
    return out_ptr


def test_par_dim_in_an_hbm_shape_keeps_every_dim():
    a = rand(3, 128, 32)
    out = exp_blocks_kernel(a)
    assert out.shape == (3, 128, 32)
    np.testing.assert_allclose(out, np.exp(a), rtol=1e-5)


@nki.jit(mode="simulation")
def row_plus_tile_kernel():
    """No arguments: simulation mode still returns numpy arrays."""
    out = nl.ndarray((128, 16), dtype=nl.float32, buffer=nl.shared_hbm)
    row = nl.full((1, 16), 2.0, dtype=nl.float32)
    nl.store(out, value=nl.add(nl.full((128, 16), 1.0, dtype=nl.float32), row))
    return out


def test_a_one_partition_tile_broadcasts_across_partitions_and_simulation_returns_numpy():
    out = row_plus_tile_kernel()
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, np.full((128, 16), 3.0, dtype=np.float32))


@nki.jit
def causal_mask_kernel(scores, offset: int):
    out = nl.ndarray(scores.shape, dtype=scores.dtype, buffer=nl.shared_hbm)
    i_q, i_k = nl.mgrid[0:scores.shape[0], 0:scores.shape[1]]
    kept = nisa.affine_select(pred=(offset + i_q >= i_k), on_true_tile=nl.load(scores), on_false_value=-1e4)
    nl.store(out, value=kept)
    return out


def test_affine_select_keeps_where_a_comparison_of_two_index_ranges_holds():
    a = rand(64, 96)
    expected = np.where(np.arange(64)[:, None] + 16 >= np.arange(96)[None, :], a, np.float32(-1e4))
    np.testing.assert_array_equal(causal_mask_kernel(a, 16), expected)


@nki.jit
def causal_exp_row_sums_kernel(qT, kT):
    """Scores in PSUM, causally masked straight from PSUM, exp'd with their row sums (flash attention's steps)."""
    out = nl.ndarray((qT.shape[1], 1), dtype=nl.float32, buffer=nl.shared_hbm)
    scores = nisa.nc_matmul(nl.load(qT), nl.load(kT))
    i_q, i_k = nl.mgrid[0:qT.shape[1], 0:kT.shape[1]]
    masked = nisa.affine_select(pred=(i_q >= i_k), on_true_tile=scores, on_false_value=-1e4, dtype=nl.float32)
    sums = nl.ndarray((qT.shape[1], 1), dtype=nl.float32)
    nisa.activation_reduce(op=np.exp, data=masked, reduce_op=np.add, reduce_res=sums)
    nl.store(out, value=sums)
    return out


def test_affine_select_takes_a_psum_tile_and_activation_reduce_returns_its_tile():
    qT, kT = rand(32, 64) * 0.1, rand(32, 64, seed=1) * 0.1
    scores = qT.T.astype(np.float64) @ kT
    expected = np.where(np.tril(np.ones((64, 64), bool)), np.exp(scores), 0.0).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(causal_exp_row_sums_kernel(qT, kT), expected, rtol=1e-4)


@nki.jit
def transposed_gram_sum_kernel(x, use_mask: bool):
    """sum over row tiles t of (x_t^T x_t - 1) * x_t^T x_t, in the old flash-attention style: a
    transpose fed straight to a matmul, a loop_reduce into a two-level block tensor, a bool mask."""
    n_tiles, d = x.shape[0] // 32, x.shape[1]
    out = nl.ndarray((d, d), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((1, 1, nl.par_dim(d), d), dtype=nl.float32, buffer=nl.sbuf)
    for t in nl.affine_range(n_tiles):
        x_t = nl.load(x[t * 32:(t + 1) * 32, :])
        gram = nisa.nc_matmul(nisa.nc_transpose(nisa.nc_transpose(x_t)), x_t, mask=use_mask)
        term = nisa.scalar_tensor_tensor(data=nl.copy(gram), op0=np.subtract, operand0=1.0, op1=np.multiply,
                                         operand1=gram)
        acc[0][0, :, :] = nl.loop_reduce(term, op=np.add, loop_indices=(t,), dtype=nl.float32)
    nl.store(out, value=acc[0, 0])
    return out


def test_loop_reduce_accumulates_into_the_tile_it_is_assigned_to_across_iterations():
    x = rand(96, 16) * 0.5
    grams = [x[t * 32:(t + 1) * 32].T.astype(np.float64) @ x[t * 32:(t + 1) * 32] for t in range(3)]
    np.testing.assert_allclose(transposed_gram_sum_kernel(x, True), sum((g - 1) * g for g in grams), rtol=1e-4,
                               atol=1e-4)


# --- the entry points: jit(mode=...), benchmark, simulate_kernel, baremetal -------------------------------
def test_benchmark_reports_the_modelled_latency_at_every_percentile():
    kernel = nki.benchmark(warmup=2, iters=5)(scale_shift_kernel)
    a, b = rand(128, 64), np.abs(rand(128, 64, seed=1))
    out = kernel(a, b)
    np.testing.assert_allclose(out, scale_shift_kernel(a, b))
    latency = kernel.benchmark_result.nc_latency
    expected = new_nki.profile(scale_shift_kernel, a, b).total_us
    assert latency.get_latency_percentile(50) == latency.get_latency_percentile(99) == pytest.approx(expected)
    with pytest.raises(NkiValidationError, match=r"available percentiles are \[0, 1, 10, 25, 50, 90, 99, 100\]"):
        latency.get_latency_percentile(33)


def test_jit_modes_simulate_kernel_and_baremetal_run_on_numpy_and_refuse_framework_tensors():
    a, b = rand(128, 64), np.abs(rand(128, 64, seed=1))
    expected = scale_shift_kernel(a, b)
    np.testing.assert_array_equal(nki.jit(mode="simulation")(scale_shift_kernel.fn)(a, b), expected)
    np.testing.assert_array_equal(nki.simulate_kernel(scale_shift_kernel, a, b), expected)
    np.testing.assert_array_equal(nki.baremetal(save_neff_name="file.neff")(scale_shift_kernel)(a, b), expected)
    with pytest.raises(TypeError, match="takes numpy arrays, got torch.Tensor"):
        nki.baremetal(scale_shift_kernel)(torch.from_numpy(a), torch.from_numpy(b))
    with pytest.raises(NkiValidationError, match="the mode must be one of auto, jax, torchxla"):
        nki.jit(mode="fast")


def test_nki_jit_refuses_the_old_mode_parameter_naming_the_fix():
    with pytest.raises(TypeError, match="nki.jit has no mode since NKI 0.3.0.*neuronxcc.nki.jit"):
        new_nki.jit(mode="simulation")


def test_a_kernel_called_from_a_kernel_runs_inline_in_the_callers_program():
    @nki.jit(mode="trace")
    def double_tile(tile):
        return tile * 2.0

    @nki.jit
    def kernel(a_input):
        out = nl.ndarray(a_input.shape, dtype=a_input.dtype, buffer=nl.shared_hbm)
        nl.store(out, double_tile(nl.load(a_input)))
        return out

    a = rand(128, 64)
    np.testing.assert_array_equal(kernel(a), a * 2.0)


# --- the old dialect's own forms inside an nki (new) kernel: the new compiler's refusal -------------------
@pytest.mark.parametrize("form", ["arange", "mask"])
def test_old_dialect_forms_inside_an_nki_kernel_are_refused_as_the_nki_compiler_does(form):
    @new_nki.jit
    def kernel(a_input):
        if form == "arange":
            return a_input[nl.arange(4)[:, None], 0]
        tile = new_nl.load(a_input)
        new_nl.exp(tile, mask=nl.arange(128)[:, None] < 64)

    with pytest.raises(NkiValidationError, match=r"is neuronxcc.nki \(the old dialect\) inside an nki.jit kernel"):
        kernel(rand(128, 64))


# --- TorchNeuron's style: a mutable output, a 1-D tensor and a scalar, on neuron tensors ---------------
def test_a_kernel_writing_its_mutable_argument_runs_on_neuron_tensors():
    @nki.jit
    def tensor_scale(x, y: nt.mutable_tensor, scale):
        x_tile = nl.load(x[0:128])
        nl.store(y[0:128], value=x_tile * scale)
        return y

    x = torch.randn(128)
    y = torch.empty(128, device="neuron")
    tensor_scale(x.to("neuron"), y, 2.5)
    torch.testing.assert_close(y.cpu(), x * 2.5)
