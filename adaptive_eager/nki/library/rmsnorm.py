"""RMSNorm in NKI: y = x * rsqrt(mean(x^2) + eps) * w, forward and backward, 128 rows a tile.

Forward: the Scalar Engine squares a row tile and sums it in the same activation; one
tensor_scalar makes mean + eps, an activation its rsqrt, and one scalar_tensor_tensor
scales by it and by the weight. The per-row rstd is returned for the backward.
Backward: dx = rstd * (g - x * rstd^2 * mean(g * x)) with g = dy * w; dw = sum over rows
of dy * x * rstd, a reduction across partitions done on the Tensor Engine (a ones vector
as the stationary operand), 512 columns per PSUM bank.
"""
from __future__ import annotations

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

from .tiles import P, row_tiles

CHUNK = 512  # float32 columns of one PSUM bank


def _broadcast_rows(vector, cols: int, dtype=nl.float32):
    """A (128, cols) SBUF tile whose every partition holds `vector` (an HBM (cols,) tensor)."""
    tile = nl.ndarray((P, cols), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=vector.reshape((1, cols)).broadcast(0, P))
    return tile


@nki.jit
def rmsnorm_forward(x, w, eps):
    """x (N, D), w (D,) -> y (N, D) in x's dtype, rstd (N, 1) float32."""
    n_rows, d = x.shape
    y = nl.ndarray((n_rows, d), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd_out = nl.ndarray((n_rows, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    w_tile = _broadcast_rows(w, d)
    for r0, n in row_tiles(n_rows):
        xt = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[r0:r0 + n, :])
        squares = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=squares, op=nl.square, data=xt, reduce_op=nl.add, reduce_res=total,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rstd = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=rstd, data=total, op0=nl.multiply, operand0=1.0 / d, op1=nl.add, operand1=eps)
        nisa.activation(dst=rstd, op=nl.rsqrt, data=rstd)
        yt = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=yt, data=xt, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                                  operand1=w_tile[0:n, :])
        nisa.dma_copy(dst=y[r0:r0 + n, :], src=yt)
        nisa.dma_copy(dst=rstd_out[r0:r0 + n, :], src=rstd)
    return y, rstd_out


@nki.jit
def rmsnorm_backward(dy, x, w, rstd):
    """-> dx (N, D) in x's dtype, dw (D,) float32."""
    n_rows, d = x.shape
    dx = nl.ndarray((n_rows, d), dtype=x.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((d,), dtype=nl.float32, buffer=nl.shared_hbm)
    w_tile = _broadcast_rows(w, d)
    dw_acc = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=dw_acc, value=0.0)
    ones = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0)
    for r0, n in row_tiles(n_rows):
        xt, gt = nl.load(x[r0:r0 + n, :], dtype=nl.float32), nl.load(dy[r0:r0 + n, :], dtype=nl.float32)
        rs = nl.load(rstd[r0:r0 + n, :])
        g = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=g, data1=gt, data2=w_tile[0:n, :], op=nl.multiply)
        gx = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        dot = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gx, data1=g, data2=xt, op=nl.multiply)
        nisa.tensor_reduce(dst=dot, op=nl.add, data=gx, axis=1)
        coef = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)  # rstd^3 * dot / d
        nisa.tensor_tensor(dst=coef, data1=rs, data2=rs, op=nl.multiply)
        nisa.tensor_tensor(dst=coef, data1=coef, data2=rs, op=nl.multiply)
        nisa.scalar_tensor_tensor(dst=coef, data=coef, op0=nl.multiply, operand0=1.0 / d, op1=nl.multiply,
                                  operand1=dot)
        scaled_g = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=scaled_g, data=g, op0=nl.multiply, operand0=rs)
        xc = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=xc, data=xt, op0=nl.multiply, operand0=coef)
        dxt = nl.ndarray((n, d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=dxt, data1=scaled_g, data2=xc, op=nl.subtract)
        nl.store(dx[r0:r0 + n, :], dxt)
        h = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)  # dy * x * rstd
        nisa.scalar_tensor_tensor(dst=h, data=xt, op0=nl.multiply, operand0=rs, op1=nl.multiply, operand1=gt)
        for c0 in range(0, d, CHUNK):
            _add_column_sums(dw_acc[:, c0:min(d, c0 + CHUNK)], ones[0:n, :], h[:, c0:min(d, c0 + CHUNK)])
    nisa.dma_copy(dst=dw.reshape((1, d)), src=dw_acc)
    return dx, dw


def _add_column_sums(acc, ones, tile):
    """acc (1, C) += the sum of tile's rows: ones.T @ tile on the Tensor Engine."""
    sums = nl.ndarray((1, tile.free_size), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=sums, stationary=ones, moving=tile)
    nisa.tensor_tensor(dst=acc, data1=acc, data2=sums, op=nl.add)
