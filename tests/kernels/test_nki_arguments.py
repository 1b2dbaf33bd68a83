"""Kernel arguments are their logical row-major arrays, as the chip's HBM holds them (issue 38,
item 1; Note [Kernel arguments are row-major arrays] in device/nki/kernel.py): a transposed or
permuted torch tensor, a Fortran-order numpy array and a slice read through `.ap()`, `reshape`
and plain indexing give the values a contiguous copy gives, and a kernel that writes such an
argument writes the caller's tensor."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import adaptive_eager
import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

g = torch.Generator().manual_seed(0)


@nki.jit
def read_by_access_pattern(x):
    """x (R, C) read back through `.ap()`: row-major [C, R] x [1, C] from element 0."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x.ap(pattern=[[C, R], [1, C]], offset=0))
    nisa.dma_copy(dst=out, src=tile)
    return out


@nki.jit
def read_by_reshape(x):
    """x (R, C) as (R, C // 2, 2) through reshape, stored back as (R, C)."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((R, C // 2, 2), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x.reshape((R, C // 2, 2)))
    nisa.dma_copy(dst=out.reshape((R, C // 2, 2)), src=tile)
    return out


@nki.jit
def read_by_index(x):
    """The second half of x's columns, by plain indexing."""
    R, C = x.shape
    out = nl.ndarray((R, C // 2), dtype=x.dtype, buffer=nl.shared_hbm)
    tile = nl.ndarray((R, C // 2), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=x[:, C // 2:])
    nisa.dma_copy(dst=out, src=tile)
    return out


@nki.jit
def double_first_row(x):
    """Writes its argument through `.ap()`: x[0] *= 2, row 0 being its first C elements."""
    R, C = x.shape
    row = nl.ndarray((1, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=x.ap(pattern=[[C, 1], [1, C]], offset=0))
    twice = nl.ndarray((1, C), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=twice, data=row, op0=nl.multiply, operand0=2.0)
    nisa.dma_copy(dst=x.ap(pattern=[[C, 1], [1, C]], offset=0), src=twice)
    return x


def _layouts():
    base = torch.randn(8, 6, generator=g)
    wide = torch.randn(3, 6, 8, generator=g)
    return {
        "transposed": base.t(),  # (6, 8), strides (1, 6)
        "permuted": wide.permute(1, 0, 2).reshape(6, 24)[:, ::3],  # a copy's slice: strided columns
        "offset_slice": torch.randn(10, 8, generator=g)[2:8],  # contiguous, but not at its storage's start
    }


@pytest.mark.parametrize("layout", ["transposed", "permuted", "offset_slice"])
@pytest.mark.parametrize("kernel", [read_by_access_pattern, read_by_reshape, read_by_index],
                         ids=["ap", "reshape", "index"])
def test_a_non_row_major_torch_argument_reads_as_its_contiguous_copy(kernel, layout):
    x = _layouts()[layout]
    assert torch.equal(kernel(x), kernel(x.contiguous()))
    assert torch.equal(read_by_access_pattern(x), x)  # and that is x's own values


@pytest.mark.parametrize("kernel", [read_by_access_pattern, read_by_reshape, read_by_index],
                         ids=["ap", "reshape", "index"])
def test_a_fortran_order_numpy_argument_reads_as_its_c_order_copy(kernel):
    a = np.asfortranarray(np.arange(48, dtype=np.float32).reshape(6, 8))
    got = kernel(a)
    assert isinstance(got, np.ndarray)
    assert np.array_equal(got, kernel(np.ascontiguousarray(a)))


@pytest.mark.parametrize("layout", ["transposed", "offset_slice"])
def test_a_kernel_writing_a_non_row_major_argument_writes_the_callers_tensor(layout):
    x = _layouts()[layout]
    expected = x.clone()
    expected[0] *= 2
    returned = double_first_row(x)
    assert torch.equal(x, expected)
    assert returned is x  # the argument it returns is the caller's tensor


def test_a_fortran_order_numpy_argument_written_by_the_kernel_is_updated():
    a = np.asfortranarray(np.arange(48, dtype=np.float32).reshape(6, 8))
    expected = a.copy()
    expected[0] *= 2
    double_first_row(a)
    assert np.array_equal(a, expected)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_on_neuron_a_transposed_argument_reads_right_and_its_copy_is_priced(mode):
    x = torch.randn(8, 6, generator=g)
    with adaptive_eager.mode(mode):
        xn = x.to("neuron")
        adaptive_eager.reset_stats()
        got = read_by_access_pattern(xn.t())
        torch.neuron.synchronize()
        transposed = adaptive_eager.stats()
        adaptive_eager.reset_stats()
        read_by_access_pattern(xn.t().contiguous())
        torch.neuron.synchronize()
        contiguous = adaptive_eager.stats()
    assert torch.equal(got.cpu(), x.t())
    # the framework's copy of the transposed argument: one more launch than the kernel's own
    # (the contiguous call's `.contiguous()` is one too)
    assert transposed.launches == contiguous.launches
    assert transposed.device_time_us == pytest.approx(contiguous.device_time_us, rel=1e-6)


@adaptive_eager.nki_op("nki_args_test::read_rows", mutates_args=())
def read_rows(x: torch.Tensor) -> torch.Tensor:
    return read_by_access_pattern(x)


def test_an_nki_op_on_a_transposed_argument_reads_right_and_prices_the_copy_in_its_launch():
    x = torch.randn(8, 6, generator=g)
    xn = x.to("neuron")
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        got = read_rows(xn.t())
        torch.neuron.synchronize()
        staged = adaptive_eager.stats()
        adaptive_eager.reset_stats()
        read_rows(xn.t().contiguous())
        torch.neuron.synchronize()
        copied_first = adaptive_eager.stats()
    assert torch.equal(got.cpu(), x.t())
    assert (staged.launches, copied_first.launches) == (1, 2)  # the copy inside the op's launch
    busy = [s.device_time_us - s.launch_overhead_us for s in (staged, copied_first)]
    assert busy[0] == pytest.approx(busy[1], rel=1e-6)
