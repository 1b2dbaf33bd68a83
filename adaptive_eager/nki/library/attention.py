"""Flash attention in NKI, forward and backward: softmax(q k^T * scale [+ causal mask]) v
without ever writing the S x S score matrix to HBM.

Layout (per batch-head program of an SPMD grid, `kernel[B * H]`): 128-row tiles of q and of
k/v. The Tensor Engine contracts over partitions, so a score tile q_i k_j^T is
nc_matmul(stationary=q_i^T [D, 128], moving=k_j^T [D, 128]); P V is
nc_matmul(stationary=P^T, moving=v_j). Transposes go through the Tensor Engine into PSUM
(nc_transpose) and are copied back to SBUF. The forward keeps the running row max m, the
running sum l and the unnormalised output o per q tile (the online softmax), and returns
o / l and the log-sum-exp m + log(l) for the backward. The causal mask is an affine_select
on the diagonal tiles (keep column j of row p where (q0 + p) - (k0 + j) >= 0), with
float32's lowest value rather than -inf, so that exp gives 0 and never NaN.

The backward recomputes each probability tile from q, k and the saved log-sum-exp:
dV_j += P^T dO_i, dP = dO_i V_j^T, dS = P * (dP - rowsum(dO_i * O_i)),
dQ_i += dS K_j * scale, dK_j += dS^T Q_i * scale.

PSUM holds 8 banks: every PSUM tile here lives inside a small helper, so at most a few are
live at once (Note [On-chip capacity] in device/nki/program.py).
"""
from __future__ import annotations

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

from .tiles import LOWEST, P, load, row_tiles, transposed

T = P  # rows of a q tile and of a k/v tile






def _scores(qT, kT, scale, causal, q0, k0):
    """(n, m) float32 SBUF tile of q_i k_j^T * scale, causally masked where the tile needs it."""
    n, m = qT.shape[1], kT.shape[1]
    s_psum = nl.ndarray((n, m), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=s_psum, stationary=qT, moving=kT)
    s = nl.ndarray((n, m), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=s, op=nl.copy, data=s_psum, scale=scale)
    if causal and k0 + m - 1 > q0:  # the tile reaches above the diagonal
        nisa.affine_select(dst=s, pattern=[[-1, m]], channel_multiplier=1, on_true_tile=s, on_false_value=LOWEST,
                           cmp_op=nl.greater_equal, offset=q0 - k0)
    return s


def _matmul_into(acc, stationary, moving, *, scale_acc=None):
    """acc = acc * scale_acc + stationary^T @ moving (scale_acc a (p, 1) tile), or acc += ... ."""
    p, f = acc.shape
    product = nl.ndarray((p, f), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=product, stationary=stationary, moving=moving)
    if scale_acc is None:
        nisa.tensor_tensor(dst=acc, data1=acc, data2=product, op=nl.add)
    else:
        nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=scale_acc, op1=nl.add,
                                  operand1=product)


@nki.jit
def flash_attention_forward(q, k, v, scale, causal):
    """q, k, v (BH, S, D) with D <= 128; launch as kernel[BH]. -> out (BH, S, D), lse (BH, S, 1)."""
    bh, s_len, d = q.shape
    out = nl.ndarray((bh, s_len, d), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((bh, s_len, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    for q0, n in row_tiles(s_len):
        qT = transposed(load(q[b, q0:q0 + n, :]), q.dtype)
        m = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=m, value=LOWEST)
        l_sum = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=l_sum, value=0.0)
        o = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=o, value=0.0)
        for k0, m_rows in row_tiles(s_len):
            if causal and k0 > q0 + n - 1:
                break
            kT = transposed(load(k[b, k0:k0 + m_rows, :]), k.dtype)
            vt = load(v[b, k0:k0 + m_rows, :])
            s = _scores(qT, kT, scale, causal, q0, k0)
            row_max = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_reduce(dst=row_max, op=nl.maximum, data=s, axis=1)
            neg_new = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)  # -max(m, row max)
            nisa.tensor_tensor(dst=neg_new, data1=m, data2=row_max, op=nl.maximum)
            nisa.tensor_scalar(dst=neg_new, data=neg_new, op0=nl.multiply, operand0=-1.0)
            p = nl.ndarray((n, m_rows), dtype=nl.float32, buffer=nl.sbuf)
            row_sum = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=p, op=nl.exp, data=s, bias=neg_new, reduce_op=nl.add, reduce_res=row_sum,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
            corr = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)  # exp(m_old - m_new)
            nisa.activation(dst=corr, op=nl.exp, data=m, bias=neg_new)
            nisa.scalar_tensor_tensor(dst=l_sum, data=l_sum, op0=nl.multiply, operand0=corr, op1=nl.add,
                                      operand1=row_sum)
            _matmul_into(o, transposed(p, v.dtype), vt, scale_acc=corr)
            nisa.tensor_scalar(dst=m, data=neg_new, op0=nl.multiply, operand0=-1.0)
        inv = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=inv, data=l_sum)
        ot = nl.ndarray((n, d), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=ot, data=o, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[b, q0:q0 + n, :], src=ot)
        log_l = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=log_l, op=nl.log, data=l_sum)
        nisa.tensor_tensor(dst=log_l, data1=log_l, data2=m, op=nl.add)
        nisa.dma_copy(dst=lse[b, q0:q0 + n, :], src=log_l)
    return out, lse


@nki.jit
def flash_attention_backward(q, k, v, out, dout, lse, scale, causal):
    """-> dq, dk, dv (BH, S, D) in the inputs' dtype; launch as kernel[BH]."""
    bh, s_len, d = q.shape
    dq = nl.ndarray((bh, s_len, d), dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((bh, s_len, d), dtype=k.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((bh, s_len, d), dtype=v.dtype, buffer=nl.shared_hbm)
    b = nl.program_id(0)
    q_tiles = row_tiles(s_len)
    # per q tile: rowsum(dO * O), -lse, and the float32 dQ accumulator
    delta, neg_lse, dq_acc = [], [], []
    for q0, n in q_tiles:
        prod = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod, data1=load(dout[b, q0:q0 + n, :], nl.float32),
                           data2=load(out[b, q0:q0 + n, :], nl.float32), op=nl.multiply)
        dt = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=dt, op=nl.add, data=prod, axis=1)
        delta.append(dt)
        nl_t = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=nl_t, data=load(lse[b, q0:q0 + n, :]), op0=nl.multiply, operand0=-1.0)
        neg_lse.append(nl_t)
        acc = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        dq_acc.append(acc)
    for k0, m_rows in row_tiles(s_len):
        kt, vt = load(k[b, k0:k0 + m_rows, :]), load(v[b, k0:k0 + m_rows, :])
        kT, vT = transposed(kt, k.dtype), transposed(vt, v.dtype)
        dk_acc = nl.ndarray((m_rows, d), dtype=nl.float32, buffer=nl.sbuf)
        dv_acc = nl.ndarray((m_rows, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dk_acc, value=0.0)
        nisa.memset(dst=dv_acc, value=0.0)
        for i, (q0, n) in enumerate(q_tiles):
            if causal and q0 + n - 1 < k0:
                continue
            qt, dot = load(q[b, q0:q0 + n, :]), load(dout[b, q0:q0 + n, :])
            s = _scores(transposed(qt, q.dtype), kT, scale, causal, q0, k0)
            p = nl.ndarray((n, m_rows), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=p, op=nl.exp, data=s, bias=neg_lse[i])
            p_in = nl.ndarray((n, m_rows), dtype=v.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=p_in, src=p)
            _matmul_into(dv_acc, p_in, dot)  # dV_j += P^T dO_i
            dp = nl.ndarray((n, m_rows), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=dp, stationary=transposed(dot, dout.dtype), moving=vT)  # dO_i V_j^T
            ds = nl.ndarray((n, m_rows), dtype=nl.float32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=ds, data=dp, op0=nl.subtract, operand0=delta[i], op1=nl.multiply,
                                      operand1=p)
            del dp
            ds_in = nl.ndarray((n, m_rows), dtype=q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=ds_in, src=ds)
            _matmul_into(dk_acc, ds_in, qt)  # dK_j += dS^T Q_i
            _matmul_into(dq_acc[i], transposed(ds, k.dtype), kt)  # dQ_i += dS K_j
        dkt = nl.ndarray((m_rows, d), dtype=k.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dkt, data=dk_acc, op0=nl.multiply, operand0=scale)
        nisa.dma_copy(dst=dk[b, k0:k0 + m_rows, :], src=dkt)
        dvt = nl.ndarray((m_rows, d), dtype=v.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dvt, src=dv_acc)
        nisa.dma_copy(dst=dv[b, k0:k0 + m_rows, :], src=dvt)
    for (q0, n), acc in zip(q_tiles, dq_acc):
        dqt = nl.ndarray((n, d), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=dqt, data=acc, op0=nl.multiply, operand0=scale)
        nisa.dma_copy(dst=dq[b, q0:q0 + n, :], src=dqt)
    return dq, dk, dv
