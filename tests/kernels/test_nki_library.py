"""The NKI kernel library (adaptive_eager.nki.library): flash attention and RMSNorm, forward
and backward, against PyTorch's composites within documented tolerances, on CPU and on
neuron, and in a training step on neuron as ops of one fused trace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import adaptive_eager
from adaptive_eager.nki import library as lib
from adaptive_eager.engine.record import record_ops
from models import neuron_steps_matching_cpu, regression_batches, train_regression

# float32 in another summation order; bfloat16 where the kernels round P and dS to the inputs' dtype
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _qkv(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [64, 200])
def test_flash_attention_matches_sdpa_forward_and_backward(dtype, causal, seq):
    q, k, v = _qkv((2, 2, seq, 32), dtype)
    out = lib.flash_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
    scale = ref.abs().max().item() * seq  # gradients grow with the sequence: compare relative to them
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float() / scale, want / scale, **TOLERANCE[dtype])


def test_flash_attention_on_neuron_gives_cpus_bits():
    q, k, v = _qkv((1, 2, 150, 16), torch.float32)
    out = lib.flash_attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    qn, kn, vn = (t.detach().to("neuron").requires_grad_() for t in (q, k, v))
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        out_n = lib.flash_attention(qn, kn, vn, causal=True)
        assert adaptive_eager.stats().launches == 1  # the whole forward kernel is one launch
        grads_n = torch.autograd.grad(out_n.sum(), (qn, kn, vn))
    assert torch.equal(out_n.cpu(), out)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(grads_n, grads))


def test_flash_attention_refuses_head_dims_past_the_partitions_and_mismatched_shapes():
    with pytest.raises(ValueError, match="head_dim 160 exceeds the 128 partitions"):
        lib.flash_attention(*[torch.zeros(1, 1, 4, 160)] * 3)
    with pytest.raises(ValueError, match="repeat k/v heads first"):
        lib.flash_attention(torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16), torch.zeros(1, 2, 8, 16))


@pytest.mark.parametrize("shape", [(300, 700), (2, 5, 64)])
def test_rms_norm_matches_f_rms_norm_forward_and_backward(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, requires_grad=True)
    y = lib.rms_norm(x, w, eps=1e-6)
    dx, dw = torch.autograd.grad(y.square().sum(), (x, w))
    ref = F.rms_norm(x, (shape[-1],), w, eps=1e-6)
    rdx, rdw = torch.autograd.grad(ref.square().sum(), (x, w))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, rdx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dw, rdw, rtol=1e-4, atol=1e-3)


class NkiBlock(nn.Module):
    """A pre-norm attention block whose attention and norms are the library's NKI kernels."""

    def __init__(self, dim=32, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.qkv, self.proj, self.head = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), nn.Linear(dim, 4)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(lib.rms_norm(x, self.norm1)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = lib.flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return self.head(lib.rms_norm(x, self.norm2))


def _train(device, mode, steps=6):
    return train_regression(NkiBlock, device, mode, regression_batches((2, 24, 32), (2, 24, 4), steps), steps)


def test_a_training_step_with_library_kernels_matches_cpu_and_runs_as_one_launch():
    per_step = neuron_steps_matching_cpu(_train)
    assert per_step[-1] == 1, per_step
    with record_ops(devices=["neuron"], source=False) as rec:
        _train("neuron", "eager", steps=1)
    kernels = sorted(n for n in rec.names() if n.startswith("nki_lib."))
    assert kernels == sorted(["nki_lib.flash_attention.default", "nki_lib.flash_attention_backward.default"]
                             + ["nki_lib.rms_norm.default", "nki_lib.rms_norm_backward.default"] * 2)


def test_library_ops_compile_as_nodes_with_their_shape_functions():
    q, k, v = (t.detach() for t in _qkv((1, 2, 40, 16), torch.float32))
    x, w = torch.randn(3, 16), torch.randn(16)

    def f(q, k, v, x, w):
        return lib.flash_attention(q, k, v, causal=True).sum() + lib.rms_norm(x, w).sum()

    torch._dynamo.reset()
    try:
        got = torch.compile(f, backend="neuron")(*(t.to("neuron") for t in (q, k, v, x, w)))
    finally:
        torch._dynamo.reset()
    assert torch.equal(got.cpu(), f(q, k, v, x, w))


def _moe_reference(x, router_w, w_gate, w_up, w_down, top_k):
    """Mixtral's block, written with torch ops."""
    logits = x @ router_w
    top, idx = logits.topk(top_k, dim=-1)
    gates = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top, -1))
    return sum(gates[:, e:e + 1] * ((F.silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]) for e in range(len(w_gate)))


def _moe_weights(d=32, e=4, f=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * scale).requires_grad_()
            for shape, scale in (((d, e), 1.0), ((e, d, f), 0.2), ((e, d, f), 0.2), ((e, f, d), 0.2))]


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_matches_the_torch_composite_forward_and_backward(top_k):
    weights = _moe_weights()
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
    y = lib.moe(x, *weights, top_k=top_k)
    grads = torch.autograd.grad(y.square().sum(), [x, *weights])
    ref = _moe_reference(x, *weights, top_k)
    ref_grads = torch.autograd.grad(ref.square().sum(), [x, *weights])
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_moe_refuses_shapes_past_one_tile_and_a_top_k_past_the_experts():
    w = _moe_weights()
    with pytest.raises(ValueError, match="top_k=5 must be in"):
        lib.moe(torch.zeros(4, 32), *w, top_k=5)
    with pytest.raises(ValueError, match="shapes do not fit"):
        lib.moe(torch.zeros(4, 16), *w)


class NkiMoeLayer(nn.Module):
    def __init__(self, d=16, e=4, f=32):
        super().__init__()
        self.params = nn.ParameterList(nn.Parameter(w.detach()) for w in _moe_weights(d, e, f))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        return self.head(x + lib.moe(x, *self.params, top_k=2))


def test_training_an_moe_layer_matches_cpu_and_runs_as_one_launch_per_step():
    def train(device, mode):
        return train_regression(NkiMoeLayer, device, mode, regression_batches((40, 16), (40, 2), 6))[:2]

    cpu_losses, _ = train("cpu", "eager")
    for mode in ("eager", "adaptive"):
        losses, per_step = train("neuron", mode)
        assert losses == cpu_losses, mode
    assert per_step[-1] == 1, per_step
