"""A mixture-of-experts block in NKI, forward and backward: a router picks the top-k experts
per token, each expert is a SiLU-gated MLP, and a token's output is its experts' outputs
weighted by the softmax of their router logits (as Mixtral's block computes it):

    gates = softmax over the top-k of (x @ router_w), 0 elsewhere
    y     = sum_e gates[:, e] * ((silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e])

Shapes: x (N, D), router_w (D, E), w_gate and w_up (E, D, F), w_down (E, F, D), with
D <= 128 and E <= 128 (one partition tile), F <= 512 (one PSUM bank of a token tile's
activations; w_down's F rows go through the Tensor Engine 128 at a time).

This is the dense formulation: every expert runs on every 128-token tile and its output is
weighted by the gate (zero for tokens not routed to it), so the modelled time is that of
E experts, not of k. A routed kernel (tokens gathered per expert with dma_copy's indirect
addressing, trip counts from registers) would cost k/E of the expert work.
The top-k threshold is the k-th largest logit of each token: logits tied with it are
selected too (random logits do not tie).
"""
from __future__ import annotations

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl

from .tiles import LOWEST, P, cast, load, row_tiles, transposed, zeros











def _matmul(stationary, moving):
    """stationary^T @ moving as a float32 SBUF tile (through one PSUM bank)."""
    res = nl.ndarray((stationary.shape[1], moving.shape[1]), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=stationary, moving=moving)
    out = nl.ndarray(res.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=res)
    return out


def _accumulate(acc, stationary, moving):
    """acc += stationary^T @ moving."""
    res = nl.ndarray(acc.shape, dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=stationary, moving=moving)
    nisa.tensor_tensor(dst=acc, data1=acc, data2=res, op=nl.add)


def _down(a_in, wd_chunks, f_len, d):
    """a (n, F) @ w_down (F, D), contracting F 128 rows at a time in one PSUM accumulation."""
    n = a_in.shape[0]
    res = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.psum)
    for i, (f0, fc) in enumerate(row_tiles(f_len)):
        nisa.nc_matmul(dst=res, stationary=transposed(a_in[:, f0:f0 + fc], a_in.dtype), moving=wd_chunks[i],
                       accumulate=i > 0)
    out = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=out, src=res)
    return out


def _gates(logits, top_k):
    """softmax over each row's top_k logits, 0 elsewhere: (n, E) float32."""
    n, e = logits.shape
    work = cast(logits, nl.float32)
    top = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    kth = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    for i in range(top_k):  # peel off the row max k times: the k-th one is the threshold
        nisa.tensor_reduce(dst=kth, op=nl.maximum, data=work, axis=1)
        if i == 0:
            nisa.tensor_copy(dst=top, src=kth)
        below = nl.ndarray((n, e), dtype=nl.uint8, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=below, data=work, op0=nl.greater_equal, operand0=kth)
        nisa.tensor_copy_predicated(dst=work, src=LOWEST, predicate=below)
    selected = nl.ndarray((n, e), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=selected, data=logits, op0=nl.greater_equal, operand0=kth)
    neg_top = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_top, data=top, op0=nl.multiply, operand0=-1.0)
    ex = nl.ndarray((n, e), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=ex, op=nl.exp, data=logits, bias=neg_top)
    nisa.tensor_tensor(dst=ex, data1=ex, data2=selected, op=nl.multiply)
    total = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=total, op=nl.add, data=ex, axis=1)
    nisa.reciprocal(dst=total, data=total)
    gates = nl.ndarray((n, e), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=gates, data=ex, op0=nl.multiply, operand0=total)
    return gates


def _expert_activations(xT, wg, wu):
    """x @ w_gate, x @ w_up, silu of the first, and the gated product a = silu(hg) * hu."""
    hg, hu = _matmul(xT, wg), _matmul(xT, wu)
    sg = nl.ndarray(hg.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sg, op=nl.silu, data=hg)
    a = nl.ndarray(hg.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=a, data1=sg, data2=hu, op=nl.multiply)
    return hg, hu, sg, a


def _expert_weights(w_gate, w_up, w_down, e, f_len):
    wg, wu = load(w_gate[e]), load(w_up[e])
    wd = [load(w_down[e, f0:f0 + fc, :]) for f0, fc in row_tiles(f_len)]
    return wg, wu, wd


def _check(x, router_w, w_gate, w_down):
    n, d = x.shape
    e, _, f = w_gate.shape
    # Raised, not asserted: asserts vanish under `python -O`, and these check the caller's shapes.
    if d > P or e > P:
        raise ValueError(f"moe kernel: D={d} and E={e} must be <= {P} (one tile of partitions)")
    if f > nl.tile_size.psum_bank_fmax:
        raise ValueError(f"moe kernel: F={f} must be <= {nl.tile_size.psum_bank_fmax} (one PSUM bank)")
    if router_w.shape != (d, e) or w_down.shape != (e, f, d):
        raise ValueError(f"moe kernel: router_w {tuple(router_w.shape)} must be (D, E) = {(d, e)} and "
                         f"w_down {tuple(w_down.shape)} must be (E, F, D) = {(e, f, d)}")
    return n, d, e, f


@nki.jit
def moe_forward(x, router_w, w_gate, w_up, w_down, top_k):
    """-> y (N, D) in x's dtype, gates (N, E) float32."""
    n_tokens, d, n_exp, f_len = _check(x, router_w, w_gate, w_down)
    y = nl.ndarray((n_tokens, d), dtype=x.dtype, buffer=nl.shared_hbm)
    gates_out = nl.ndarray((n_tokens, n_exp), dtype=nl.float32, buffer=nl.shared_hbm)
    wr = load(router_w)
    for r0, n in row_tiles(n_tokens):
        xT = transposed(load(x[r0:r0 + n, :]), x.dtype)
        gates = _gates(_matmul(xT, wr), top_k)
        nisa.dma_copy(dst=gates_out[r0:r0 + n, :], src=gates)
        y_acc = zeros((n, d))
        for e in range(n_exp):
            wg, wu, wd = _expert_weights(w_gate, w_up, w_down, e, f_len)
            a = _expert_activations(xT, wg, wu)[3]
            out_e = _down(cast(a, x.dtype), wd, f_len, d)
            nisa.scalar_tensor_tensor(dst=y_acc, data=out_e, op0=nl.multiply, operand0=gates[:, e:e + 1], op1=nl.add,
                                      operand1=y_acc)
        nisa.dma_copy(dst=y[r0:r0 + n, :], src=y_acc)
    return y, gates_out


@nki.jit
def moe_backward(dy, x, router_w, w_gate, w_up, w_down, gates):
    """-> dx (N, D) in x's dtype; d router_w (D, E), d w_gate, d w_up (E, D, F), d w_down (E, F, D) float32."""
    n_tokens, d, n_exp, f_len = _check(x, router_w, w_gate, w_down)
    dt = x.dtype
    dx = nl.ndarray((n_tokens, d), dtype=dt, buffer=nl.shared_hbm)
    d_router = nl.ndarray((d, n_exp), dtype=nl.float32, buffer=nl.shared_hbm)
    d_gate = nl.ndarray((n_exp, d, f_len), dtype=nl.float32, buffer=nl.shared_hbm)
    d_up = nl.ndarray((n_exp, d, f_len), dtype=nl.float32, buffer=nl.shared_hbm)
    d_down = nl.ndarray((n_exp, f_len, d), dtype=nl.float32, buffer=nl.shared_hbm)
    wr = load(router_w)
    wrT = transposed(wr, dt)  # (E, D)
    dr_acc = zeros((d, n_exp))
    dg_acc = [zeros((d, f_len)) for _ in range(n_exp)]
    du_acc = [zeros((d, f_len)) for _ in range(n_exp)]
    dd_acc = [[zeros((fc, d)) for _, fc in row_tiles(f_len)] for _ in range(n_exp)]
    for r0, n in row_tiles(n_tokens):
        xt = load(x[r0:r0 + n, :])
        xT = transposed(xt, dt)
        dyt = load(dy[r0:r0 + n, :], nl.float32)
        g = load(gates[r0:r0 + n, :])
        dgate = zeros((n, n_exp))
        dx_acc = zeros((n, d))
        for e in range(n_exp):
            wg, wu, wd = _expert_weights(w_gate, w_up, w_down, e, f_len)
            hg, hu, sg, a = _expert_activations(xT, wg, wu)
            a_in = cast(a, dt)
            # d gate[:, e] = sum over D of dy * expert output
            prod = nl.ndarray((n, d), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=prod, data1=dyt, data2=_down(a_in, wd, f_len, d), op=nl.multiply)
            nisa.tensor_reduce(dst=dgate[:, e:e + 1], op=nl.add, data=prod, axis=1)
            dout = nl.ndarray((n, d), dtype=dt, buffer=nl.sbuf)  # dy * gate
            nisa.tensor_scalar(dst=dout, data=dyt, op0=nl.multiply, operand0=g[:, e:e + 1])
            for i, (f0, fc) in enumerate(row_tiles(f_len)):
                _accumulate(dd_acc[e][i], a_in[:, f0:f0 + fc], dout)  # d w_down += a^T dout
            wdT = nl.ndarray((d, f_len), dtype=dt, buffer=nl.sbuf)  # w_down[e]^T, chunk by chunk
            for i, (f0, fc) in enumerate(row_tiles(f_len)):
                nisa.tensor_copy(dst=wdT[:, f0:f0 + fc], src=transposed(wd[i], dt))
            da = _matmul(transposed(dout, dt), wdT)  # (n, F)
            dhu = nl.ndarray((n, f_len), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dhu, data1=da, data2=sg, op=nl.multiply)
            dhg = nl.ndarray((n, f_len), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=dhg, op=nl.silu_dx, data=hg)
            nisa.tensor_tensor(dst=dhg, data1=dhg, data2=hu, op=nl.multiply)
            nisa.tensor_tensor(dst=dhg, data1=dhg, data2=da, op=nl.multiply)
            dhg_in, dhu_in = cast(dhg, dt), cast(dhu, dt)
            _accumulate(dg_acc[e], xt, dhg_in)  # d w_gate += x^T dhg
            _accumulate(du_acc[e], xt, dhu_in)
            for f0, fc in row_tiles(f_len):  # dx += dhg w_gate^T + dhu w_up^T, contracting F
                _accumulate(dx_acc, transposed(dhg_in[:, f0:f0 + fc], dt), transposed(wg[:, f0:f0 + fc], dt))
                _accumulate(dx_acc, transposed(dhu_in[:, f0:f0 + fc], dt), transposed(wu[:, f0:f0 + fc], dt))
        # the router: d logits = gates * (d gates - sum(gates * d gates)), zero where not selected
        gd = nl.ndarray((n, n_exp), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gd, data1=g, data2=dgate, op=nl.multiply)
        s = nl.ndarray((n, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=gd, axis=1)
        dl = nl.ndarray((n, n_exp), dtype=dt, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=dl, data=dgate, op0=nl.subtract, operand0=s, op1=nl.multiply, operand1=g)
        _accumulate(dr_acc, xt, dl)
        _accumulate(dx_acc, transposed(dl, dt), wrT)
        nisa.dma_copy(dst=dx[r0:r0 + n, :], src=dx_acc)
    nisa.dma_copy(dst=d_router, src=dr_acc)
    for e in range(n_exp):
        nisa.dma_copy(dst=d_gate[e], src=dg_acc[e])
        nisa.dma_copy(dst=d_up[e], src=du_acc[e])
        for i, (f0, fc) in enumerate(row_tiles(f_len)):
            nisa.dma_copy(dst=d_down[e, f0:f0 + fc, :], src=dd_acc[e][i])
    return dx, d_router, d_gate, d_up, d_down
