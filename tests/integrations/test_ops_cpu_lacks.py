"""Ops with no CPU kernel that real code calls on an accelerator (issue 37, item 7): neuron
gives each a kernel (dispatch/linear_backward.py, dispatch/sync_batch_norm.py). Before, each
raised "has no CPU kernel"."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager

MODES = ["eager", "adaptive"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4)])
def test_linear_backward_gives_cpu_autograds_bits_for_each_asked_gradient(shape, mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(5, 4, generator=g, requires_grad=True)
    b = torch.randn(5, generator=g, requires_grad=True)
    gy = torch.randn(*shape[:-1], 5, generator=g)
    F.linear(x, w, b).backward(gy)
    with adaptive_eager.mode(mode):
        for _ in range(4):  # adaptive: replayed in a trace too
            got = torch.ops.aten.linear_backward(x.detach().to("neuron"), gy.to("neuron"), w.detach().to("neuron"),
                                                 [True, True, True])
            assert [torch.equal(a.cpu(), e) for a, e in zip(got, (x.grad, w.grad, b.grad))] == [True] * 3
        only_weight = torch.ops.aten.linear_backward(x.detach().to("neuron"), gy.to("neuron"),
                                                     w.detach().to("neuron"), [False, True, False])
    assert [t is None for t in only_weight] == [True, False, True]


@pytest.mark.parametrize("mode", MODES)
def test_sync_batch_norms_kernels_over_two_shards_give_one_batch_norm_over_the_whole_batch(mode):
    """SyncBatchNorm's flow (torch/nn/modules/_functions.py) on two shards in one process, the
    collectives done by hand: the same values as F.batch_norm over the whole batch on CPU, to
    float32 rounding, and the running statistics too."""
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 3, 4, 4, generator=g), torch.randn(3, generator=g), torch.randn(3, generator=g)
    gy = torch.randn(6, 3, 4, 4, generator=g)
    eps, momentum = 1e-5, 0.1
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    running = torch.zeros(3), torch.ones(3)
    F.batch_norm(xr, *running, wr, br, training=True, momentum=momentum, eps=eps).backward(gy)
    with adaptive_eager.mode(mode):
        shards, grads = [x[:2].to("neuron"), x[2:].to("neuron")], [gy[:2].to("neuron"), gy[2:].to("neuron")]
        wn, bn = w.to("neuron"), b.to("neuron")
        rm, rv = torch.zeros(3, device="neuron"), torch.ones(3, device="neuron")
        stats = [torch.batch_norm_stats(s, eps) for s in shards]
        counts = torch.tensor([2 * 16.0, 4 * 16.0], device="neuron")
        mean, invstd = torch.batch_norm_gather_stats_with_counts(
            shards[0], torch.stack([m for m, _ in stats]), torch.stack([i for _, i in stats]), rm, rv, momentum, eps,
            counts)
        out = torch.cat([torch.batch_norm_elemt(s, wn, bn, mean, invstd, eps) for s in shards])
        reduced = [torch.batch_norm_backward_reduce(gs, s, mean, invstd, wn, True, True, True)
                   for gs, s in zip(grads, shards)]
        sum_dy, sum_dy_xmu = sum(r[0] for r in reduced), sum(r[1] for r in reduced)
        count = torch.tensor([32, 64], dtype=torch.int32, device="neuron")
        grad_input = torch.cat([torch.batch_norm_backward_elemt(gs, s, mean, invstd, wn, sum_dy, sum_dy_xmu, count)
                                for gs, s in zip(grads, shards)])
        grad_weight, grad_bias = sum(r[2] for r in reduced), sum(r[3] for r in reduced)
    expected = F.batch_norm(x, torch.zeros(3), torch.ones(3), w, b, training=True, momentum=momentum, eps=eps)
    for got, want in ((out, expected), (grad_input, xr.grad), (grad_weight, wr.grad), (grad_bias, br.grad),
                      (rm, running[0]), (rv, running[1])):
        assert got.device.type == "neuron"
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _per_sequence_sdpa(q, k, v, offsets_q, offsets_k, mask_of):
    """The reference varlen attention must equal: CPU's SDPA on each sequence alone, (total,
    heads, dim) sliced and laid out as SDPA's (1, heads, seqlen, dim)."""
    outs = []
    for (a, b), (c, d) in zip(zip(offsets_q, offsets_q[1:]), zip(offsets_k, offsets_k[1:])):
        qs, ks, vs = (t[s:e].transpose(0, 1).unsqueeze(0) for t, s, e in ((q, a, b), (k, c, d), (v, c, d)))
        mask = mask_of(b - a, d - c)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True).squeeze(0).transpose(0, 1))
    return torch.cat(outs)


def _bottom_right_window(left, right):
    """flash-attn's window: query i sees key j when i + sk - sq - left <= j <= i + sk - sq + right."""
    def mask_of(sq, sk):
        if left < 0 and right < 0:
            return None
        i = torch.arange(sq)[:, None] + sk - sq
        j = torch.arange(sk)[None]
        return ((j >= i - left) if left >= 0 else torch.ones(sq, sk, dtype=torch.bool)) & \
            ((j <= i + right) if right >= 0 else torch.ones(sq, sk, dtype=torch.bool))
    return mask_of


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (2, 0), (1, 1)])
def test_varlen_attention_gives_cpu_sdpa_on_each_sequence_forward_and_backward(window, mode):
    """torch.nn.attention.varlen.varlen_attn (torchtitan's packed-document attention) calls
    aten::_flash_attention_forward/_backward, which have no CPU kernel: on neuron it raised
    "has no CPU kernel". Now each sequence gets the bits of CPU's SDPA on it alone, with
    grouped-query heads, causal and sliding windows, output and all three gradients."""
    from torch.nn.attention.varlen import varlen_attn

    g = torch.Generator().manual_seed(0)
    lens, heads, kv_heads, dim = [5, 3, 7], 4, 2, 8
    offsets = [0, 5, 8, 15]
    q, k, v = (torch.randn(15, h, dim, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(15, heads, dim, generator=g)
    expected = _per_sequence_sdpa(q, k, v, offsets, offsets, _bottom_right_window(*window))
    expected.backward(grad)
    cu = torch.tensor(offsets, dtype=torch.int32)
    with adaptive_eager.mode(mode):
        for _ in range(3):  # adaptive: recorded, then replayed
            qn, kn, vn = (t.detach().to("neuron").requires_grad_() for t in (q, k, v))
            out = varlen_attn(qn, kn, vn, cu.to("neuron"), cu.to("neuron"), max(lens), max(lens), window_size=window,
                              enable_gqa=True)
            out.backward(grad.to("neuron"))
            assert torch.equal(out.cpu(), expected)
            assert [torch.equal(a.grad.cpu(), e.grad) for a, e in zip((qn, kn, vn), (q, k, v))] == [True] * 3


@pytest.mark.parametrize("mode", MODES)
def test_flash_attention_aligns_a_causal_mask_to_the_bottom_right_when_queries_are_fewer_than_keys(mode):
    """flash-attn's causal mask for sq < sk (decoding against a cache) lets the last query see
    every key; CPU SDPA's is_causal is top-left aligned, so the kernel must not pass it through."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2 + 3, 2, 8, generator=g)
    k, v = torch.randn(6 + 4, 2, 8, generator=g), torch.randn(6 + 4, 2, 8, generator=g)
    expected = _per_sequence_sdpa(q, k, v, [0, 2, 5], [0, 6, 10], _bottom_right_window(-1, 0))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 6, 10], dtype=torch.int32)
    with adaptive_eager.mode(mode):
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q.to("neuron"), k.to("neuron"), v.to("neuron"), cu_q.to("neuron"), cu_k.to("neuron"), 3, 6, 0.0, True,
            False)
        assert torch.equal(out.cpu(), expected)
        assert lse.shape == (2, 5) and lse.dtype == torch.float32


@pytest.mark.parametrize("mode", MODES)
def test_dense_flash_attention_gives_cpu_flash_kernels_bits_in_its_batch_seqlen_heads_layout(mode):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 6, 3, 8, generator=g) for _ in range(3))  # (batch, seqlen, heads, dim)
    go = torch.randn(2, 6, 3, 8, generator=g)
    ref, ref_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, True)
    ref_grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        go.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ref, ref_lse, 0.0, True)
    with adaptive_eager.mode(mode):
        qn, kn, vn, gn = (t.to("neuron") for t in (q, k, v, go))
        out, lse, seed, offset, debug = torch.ops.aten._flash_attention_forward(qn, kn, vn, None, None, 6, 6, 0.0,
                                                                              True, False)
        grads = torch.ops.aten._flash_attention_backward(gn, qn, kn, vn, out, lse, torch.empty(0, device="neuron"),
                                                         torch.empty(0, device="neuron"), 6, 6, 0.0, True, seed,
                                                         offset)
        assert torch.equal(out.cpu(), ref.transpose(1, 2)) and torch.equal(lse.cpu(), ref_lse)
        assert [torch.equal(a.cpu(), e.transpose(1, 2)) for a, e in zip(grads, ref_grads)] == [True] * 3
        assert (seed.shape, seed.dtype, debug.numel()) == ((2,), torch.uint64, 0)


@pytest.mark.parametrize("mode", MODES)
def test_varlen_attention_into_a_given_output_and_with_keys_used_per_sequence(mode):
    """varlen_attn_out writes the output in place; seqused_k (a cache's filled length) keeps
    only each sequence's first keys."""
    from torch.nn.attention.varlen import varlen_attn_out

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    expected = _per_sequence_sdpa(q, k, v, [0, 4, 9], [0, 4, 9], _bottom_right_window(-1, 0))
    used = torch.tensor([2, 3], dtype=torch.int32)
    expected_used = _per_sequence_sdpa(q, torch.cat([k[0:2], k[4:7]]), torch.cat([v[0:2], v[4:7]]), [0, 4, 9],
                                       [0, 2, 5], _bottom_right_window(-1, -1))
    with adaptive_eager.mode(mode):
        qn, kn, vn, cun = (t.to("neuron") for t in (q, k, v, cu))
        out = torch.full((9, 2, 8), float("nan"), device="neuron")
        assert varlen_attn_out(out, qn, kn, vn, cun, cun, 5, 5, window_size=(-1, 0)) is out
        assert torch.equal(out.cpu(), expected)
        got, *_ = torch.ops.aten._flash_attention_forward(qn, kn, vn, cun, cun, 5, 5, 0.0, False, False,
                                                          seqused_k=used.to("neuron"))
        assert torch.equal(got.cpu(), expected_used)


def test_flash_attention_refuses_what_it_cannot_compute_and_says_what_to_use():
    q = torch.randn(4, 2, 8, device="neuron")
    cu = torch.tensor([0, 4], dtype=torch.int32, device="neuron")
    with pytest.raises(NotImplementedError, match=r"dropout_p=0.1 .*scaled_dot_product_attention"):
        torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.1, False, False)
    with pytest.raises(NotImplementedError, match=r"paged KV cache \(block_table\).*contiguous"):
        torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 4, 4, 0.0, False, False,
                                                block_table=torch.zeros(1, 1, dtype=torch.int32, device="neuron"))
    with pytest.raises(RuntimeError, match=r"cum_seq_q must start at 0 and never decrease"):
        torch.ops.aten._flash_attention_forward(q, q, q, torch.tensor([0, 3, 2], dtype=torch.int32,
                                                                       device="neuron"), None, 4, 4, 0.0, False, False)
    with pytest.raises(RuntimeError, match=r"query must be 3-D \(total, heads, head_dim\) with cum_seq_q"):
        torch.ops.aten._flash_attention_forward(q[None], q, q, cu, cu, 4, 4, 0.0, False, False)


@pytest.mark.parametrize("mode", MODES)
def test_out_forms_of_the_kernels_cpu_lacks_write_the_functional_results_into_the_given_tensors(mode):
    """Each op given a kernel here has an out= overload, a separate op: before, on neuron,
    `torch.batch_norm_stats(x, eps, out=...)` and the others raised "has no CPU kernel"."""
    g = torch.Generator().manual_seed(4)
    x, gy = torch.randn(4, 3, 5, generator=g).to("neuron"), torch.randn(4, 3, 5, generator=g).to("neuron")
    w = torch.randn(3, generator=g).to("neuron")
    aten = torch.ops.aten
    with adaptive_eager.mode(mode):
        mean, invstd = torch.batch_norm_stats(x, 1e-5)
        counts = torch.full((2,), 20.0, device="neuron")
        cases = [
            (aten.batch_norm_stats, (x, 1e-5), 2),
            (aten.batch_norm_gather_stats_with_counts,
             (x, mean.repeat(2, 1), invstd.repeat(2, 1), None, None, 0.1, 1e-5, counts), 2),
            (aten.batch_norm_elemt, (x, w, None, mean, invstd, 1e-5), 1),
            (aten.batch_norm_backward_reduce, (gy, x, mean, invstd, w, True, True, True), 4),
            (aten.linear_backward, (x, gy[..., :4], torch.randn(4, 5, device="neuron"), [True, True, True]), 3),
        ]
        for op, args, n in cases:
            expected = op.default(*args)
            expected = (expected,) if n == 1 else expected
            outs = [torch.empty(0, device="neuron") for _ in range(n)]
            names = ("out",) if n == 1 else tuple(f"out{i}" for i in range(n))
            got = op.out(*args, **dict(zip(names, outs)))
            got = (got,) if n == 1 else got
            assert all(a is b for a, b in zip(got, outs)), op
            assert [torch.equal(a.cpu(), e.cpu()) for a, e in zip(outs, expected)] == [True] * n, op
        # The older gather_stats: one count for every rank's shard, the same statistics.
        stats = torch.batch_norm_gather_stats(x, mean.repeat(2, 1), invstd.repeat(2, 1), None, None, 0.1, 1e-5, 20)
        with_counts = torch.batch_norm_gather_stats_with_counts(x, mean.repeat(2, 1), invstd.repeat(2, 1), None,
                                                                None, 0.1, 1e-5, counts)
        assert [torch.equal(a.cpu(), b.cpu()) for a, b in zip(stats, with_counts)] == [True, True]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_opinfos_flash_attention_samples_give_cpu_flash_with_flash_attns_causal_alignment(dtype):
    """OpInfo's own samples of aten::_flash_attention_forward (dense, 11 queries against 32
    keys): without dropout, CPU's flash kernel's bits under a bottom-right causal mask; with
    dropout, the refusal naming what to use."""
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if o.name == "torch.ops.aten._flash_attention_forward")
    seen = {"value": 0, "refused": 0}
    for sample in op.sample_inputs("cpu", dtype):
        q, (k, v), kw = sample.input, sample.args, sample.kwargs
        on_neuron = [t.to("neuron") for t in (q, k, v)]
        if kw["dropout_p"]:
            with pytest.raises(NotImplementedError, match="dropout_p"):
                op(*on_neuron, **kw)
            seen["refused"] += 1
            continue
        sq, sk = q.shape[1], k.shape[1]
        mask = _bottom_right_window(-1, 0 if kw["is_causal"] else -1)(sq, sk)
        additive = None if mask is None else torch.zeros(sq, sk, dtype=dtype).masked_fill(~mask, float("-inf"))
        expected, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.0, False, attn_mask=additive, scale=kw["scale"])
        got = op(*on_neuron, **kw)
        assert torch.equal(got[0].cpu(), expected.transpose(1, 2)) and torch.equal(got[1].cpu(), lse)
        seen["value"] += 1
    assert seen["value"] >= 2 and seen["refused"] >= 1, seen


@pytest.mark.parametrize("call", [
    lambda q: torch.ops.aten._scaled_dot_product_efficient_attention(q, q, q, None, False),
    lambda q: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q),
    lambda q: torch.ops.aten._efficient_attention_forward(q, q, q, None, None, None, None, None, 0.0, 0, False),
], ids=["sdpa_efficient", "sdpa_flash", "efficient_attention_forward"])
def test_cudas_fused_attention_kernels_are_refused_naming_the_public_call_that_runs_on_neuron(call):
    with pytest.raises(NotImplementedError, match=r"has no CPU kernel.*call torch\.nn\.functional\.scaled_dot_product_"
                                                  r"attention, which runs on neuron.*varlen_attn"):
        call(torch.randn(1, 2, 4, 8, device="neuron"))
