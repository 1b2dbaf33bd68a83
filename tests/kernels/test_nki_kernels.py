"""Whole NKI kernels in the tutorials' style, written here, run on the emulated NeuronCore
with torch and numpy inputs and compared with torch: tiling, PSUM accumulation, SPMD grids,
kernels that write their inputs, and kernels with errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

g = torch.Generator().manual_seed(0)

TILE_K, TILE_M, TILE_N = 128, 128, 512


@nki.jit
def tiled_matmul(lhsT, rhs):
    """result = lhsT.T @ rhs, tiled over M, N and the contraction K, accumulating in PSUM."""
    K, M = lhsT.shape
    K2, N = rhs.shape
    assert K == K2
    result = nl.ndarray((M, N), dtype=nl.float32, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TILE_M):
        for n in nl.affine_range(N // TILE_N):
            acc = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.psum)
            for k in nl.sequential_range(K // TILE_K):
                a = nl.ndarray((TILE_K, TILE_M), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TILE_K, TILE_N), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TILE_K:(k + 1) * TILE_K, m * TILE_M:(m + 1) * TILE_M])
                nisa.dma_copy(dst=b, src=rhs[k * TILE_K:(k + 1) * TILE_K, n * TILE_N:(n + 1) * TILE_N])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b, accumulate=(k > 0))
            res = nl.ndarray((TILE_M, TILE_N), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=result[m * TILE_M:(m + 1) * TILE_M, n * TILE_N:(n + 1) * TILE_N], src=res)
    return result


@nki.jit
def row_softmax(x):
    """softmax over the free dim, 128 rows at a time: max, exp with the sum in the same
    activation, reciprocal, scale."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    for r in range(R // 128):
        rows = nl.ndarray((128, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=rows, src=x[r * 128:(r + 1) * 128, :])
        neg_max = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=neg_max, op=nl.maximum, data=rows, axis=1, negate=True)
        e = nl.ndarray((128, C), dtype=nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=rows, bias=neg_max, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        inv = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=total)
        y = nl.ndarray((128, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=y, data=e, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[r * 128:(r + 1) * 128, :], src=y)
    return out


@nki.jit
def layernorm(x, gamma, beta, eps=1e-5):
    """layer norm over the free dim with bn_stats/bn_aggr; gamma and beta broadcast over
    partitions with a stride-0 HBM view."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    g_tile = nl.ndarray((128, C), dtype=nl.float32, buffer=nl.sbuf)
    b_tile = nl.ndarray((128, C), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=g_tile, src=gamma.reshape((1, C)).broadcast(0, 128))
    nisa.dma_copy(dst=b_tile, src=beta.reshape((1, C)).broadcast(0, 128))
    chunks = (C + 511) // 512
    for r in range(R // 128):
        rows = nl.load(x[r * 128:(r + 1) * 128, :], dtype=nl.float32)
        stats = nl.ndarray((128, 6 * chunks), dtype=nl.float32, buffer=nl.sbuf)
        for c in range(chunks):
            hi = min(C, (c + 1) * 512)
            nisa.bn_stats(dst=stats[:, 6 * c:6 * (c + 1)], data=rows[:, c * 512:hi])
        mv = nl.ndarray((128, 2), dtype=nl.float32, buffer=nl.sbuf)
        nisa.bn_aggr(dst=mv, data=stats)
        rstd = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rstd, data=mv[:, 1:2], op0=nl.add, operand0=eps, op1=nl.rsqrt, operand1=0.0)
        norm = nl.ndarray((128, C), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=norm, data=rows, op0=nl.subtract, operand0=mv[:, 0:1], op1=nl.multiply,
                           operand1=rstd)
        nisa.tensor_tensor(dst=norm, data1=norm, data2=g_tile, op=nl.multiply)
        y = nl.ndarray((128, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=y, data1=norm, data2=b_tile, op=nl.add)
        nl.store(out[r * 128:(r + 1) * 128, :], y)
    return out


def test_tiled_matmul_accumulates_k_tiles_in_psum():
    a = torch.randn(384, 256, generator=g).bfloat16()
    b = torch.randn(384, 1024, generator=g).bfloat16()
    torch.testing.assert_close(tiled_matmul(a, b), a.float().t() @ b.float(), rtol=1e-5, atol=1e-4)


def test_tiled_matmul_takes_numpy_arrays_and_returns_one():
    a = np.random.default_rng(0).standard_normal((128, 128), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((128, 512), dtype=np.float32)
    result = tiled_matmul(a, b)
    assert isinstance(result, np.ndarray)
    np.testing.assert_allclose(result, a.T @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_kernel_matches_torch(dtype):
    x = (4 * torch.randn(256, 300, generator=g)).to(dtype)
    ref = torch.softmax(x.float(), dim=1).to(dtype)
    torch.testing.assert_close(row_softmax(x), ref, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_layernorm_kernel_matches_torch():
    x = torch.randn(256, 700, generator=g) * 3 + 1
    gamma, beta = torch.randn(700, generator=g), torch.randn(700, generator=g)
    ref = torch.nn.functional.layer_norm(x, (700,), gamma, beta, eps=1e-5)
    torch.testing.assert_close(layernorm(x, gamma, beta), ref, rtol=1e-4, atol=1e-4)


def test_language_level_functions_match_torch():
    @nki.jit
    def kernel(x, y):
        a, b = nl.load(x), nl.load(y)
        out = nl.ndarray((x.shape[0], 5 * x.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
        c = x.shape[1]
        nl.store(out[:, 0:c], nl.add(nl.multiply(a, b), 1.0))
        nl.store(out[:, c:2 * c], nl.exp(nl.subtract(a, nl.max(a, axis=1, keepdims=True))))
        nl.store(out[:, 2 * c:3 * c], nl.softmax(a, axis=1))
        nl.store(out[:, 3 * c:4 * c], nl.where(nl.greater(a, b), a, b))
        nl.store(out[:, 4 * c:5 * c], nl.copy(nl.matmul(a[:, 0:x.shape[0]], b, transpose_x=True)))
        return out

    x, y = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    r = kernel(x, y)
    torch.testing.assert_close(r[:, 0:64], x * y + 1)
    torch.testing.assert_close(r[:, 64:128], torch.exp(x - x.amax(1, keepdim=True)))
    torch.testing.assert_close(r[:, 128:192], torch.softmax(x, 1))
    torch.testing.assert_close(r[:, 192:256], torch.maximum(x, y))
    torch.testing.assert_close(r[:, 256:320], x.t() @ y, rtol=1e-5, atol=1e-4)


def test_an_spmd_grid_runs_every_program_on_its_own_slice():
    @nki.jit
    def scale_rows(x, out):
        i = nl.program_id(0)
        tile = nl.load(x[i * 128:(i + 1) * 128, :])
        nl.store(out[i * 128:(i + 1) * 128, :], nl.multiply(tile, float(nl.num_programs())))
        return out

    x = torch.randn(512, 32, generator=g)
    out = torch.zeros(512, 32)
    returned = scale_rows[4](x, out)
    assert returned is out  # a kernel that returns its output argument returns the caller's tensor
    assert torch.equal(out, x * 4)


def test_shared_hbm_allocated_in_an_spmd_kernel_is_one_tensor_for_all_programs():
    @nki.jit
    def fill(x):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        i = nl.program_id(0)
        nl.store(out[i:i + 1, :], nl.add(nl.load(x[i:i + 1, :]), float(i)))
        return out

    x = torch.zeros(3, 8)
    assert torch.equal(fill[3](x), torch.arange(3.0).reshape(3, 1).expand(3, 8))


def test_reading_an_unwritten_tile_shows_as_nan():
    @nki.jit
    def forgets_half(x):
        t = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[:, 0:32], src=x[:, 0:32])  # the other half is never written
        out = nl.ndarray((128, 64), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    r = forgets_half(torch.ones(128, 64))
    assert (r[:, :32] == 1).all() and torch.isnan(r[:, 32:]).all()


def test_a_kernel_that_breaks_a_limit_raises_at_its_line():
    @nki.jit
    def too_tall(x):
        t = nl.ndarray((256, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)

    with pytest.raises(nisa.NkiValidationError, match="dma_copy dst partition dimension 256 exceeds maximum 128") as e:
        too_tall(torch.zeros(256, 8))
    assert any(f.name == "too_tall" for f in e.traceback)


def test_kernel_arguments_of_unsupported_dtypes_are_refused():
    @nki.jit
    def nothing(x):
        return x

    with pytest.raises(TypeError, match="int64 and float64 have no NeuronCore equivalent"):
        nothing(torch.zeros(4, dtype=torch.int64))


@nki.jit
def strided_column_copy(x):
    """Copies every other 128-column block of x (blocks 1, 3, 5) with the NKI library's
    `nl.range(start, stop, step)`, and doubles each with `nl.range(2)` adds."""
    out = nl.ndarray((128, 3 * 128), dtype=x.dtype, buffer=nl.shared_hbm)
    for j, b in enumerate(nl.range(1, 7, 2)):
        tile = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=tile, src=x[:, b * 128:(b + 1) * 128])
        acc = nl.ndarray((128, 128), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        for _ in nl.range(2):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=tile, op=nl.add)
        nisa.dma_copy(dst=out[:, j * 128:(j + 1) * 128], src=acc)
    return out


def test_nl_range_iterates_as_pythons_range_so_nki_library_loops_run():
    x = torch.randn(128, 7 * 128, generator=g)
    want = torch.cat([2 * x[:, b * 128:(b + 1) * 128] for b in (1, 3, 5)], dim=1)
    torch.testing.assert_close(strided_column_copy(x), want)
    for args in [(5,), (2, 9), (1, 10, 3), (6, 0, -2), (0,)]:
        assert list(nl.range(*args)) == list(range(*args)), args


def test_nl_range_is_the_same_iterator_as_the_deprecated_static_ranges():
    # the docs make affine/sequential/static_range Python's range from NKI 0.7; nl.range is that iterator
    assert nl.range is nl.sequential_range is nl.affine_range is nl.static_range
