"""The NKI kernel library against the same computation as plain ATen ops on the device:
wall time of the emulation (pytest-benchmark) and, in extra_info, what the chip would spend
(modelled device µs and launches, from adaptive_eager.stats()), in eager mode, one call.

    python -m pytest bench/bench_nki.py -q --benchmark-only

The modelled times are deterministic; the wall times are of the host emulating the chip
(an NKI kernel runs instruction by instruction in Python), so compare ratios of the
modelled figures, and read the wall times only as what a test run costs.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import adaptive_eager
from adaptive_eager.nki import library as lib
from adaptive_eager.dispatch.context import CONTEXT


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 8, 1024, 128, generator=g).bfloat16().to("neuron") for _ in range(3)]


def _attention_aten(q, k, v):
    s = (q @ k.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(s.masked_fill(mask, float("-inf")).float(), -1).to(q.dtype) @ v


def _rms_inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4096, 1024, generator=g).bfloat16().to("neuron"), torch.randn(1024, generator=g).bfloat16().to("neuron")


def _rms_aten(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


def _moe_inputs():
    g = torch.Generator().manual_seed(0)
    shapes = ((1024, 128), (128, 8), (8, 128, 512), (8, 128, 512), (8, 512, 128))
    return [(torch.randn(s, generator=g) * 0.1).bfloat16().to("neuron") for s in shapes]


def _moe_aten(x, router_w, w_gate, w_up, w_down):
    logits = x @ router_w
    top, idx = logits.topk(2, -1)
    gates = torch.zeros_like(logits).scatter(1, idx, torch.softmax(top.float(), -1).to(logits.dtype))
    return sum(gates[:, e:e + 1] * ((F.silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]) for e in range(len(w_gate)))


CASES = {
    "attention (1x8x1024x128 bf16, causal)": (_attention_inputs, lambda q, k, v: lib.flash_attention(q, k, v, causal=True),
                                              _attention_aten),
    "rms_norm (4096x1024 bf16)": (_rms_inputs, lib.rms_norm, _rms_aten),
    "moe (1024 tokens, D 128, 8 experts of F 512, top-2, bf16)": (_moe_inputs, lambda *a: lib.moe(*a, top_k=2),
                                                                   _moe_aten),
}


@pytest.mark.parametrize("impl", ["nki", "aten"])
@pytest.mark.parametrize("case", list(CASES))
def test_library_kernel_against_aten_ops(benchmark, case, impl):
    make, nki_fn, aten_fn = CASES[case]
    benchmark.group = f"nki library: {case}"
    inputs = make()
    fn = nki_fn if impl == "nki" else aten_fn
    with adaptive_eager.mode("eager"):
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        fn(*inputs)
        torch.neuron.synchronize()
        s = adaptive_eager.stats()
        config = CONTEXT.runtime.config
        benchmark.extra_info.update(device_us=round(s.device_time_us, 1), launches=s.launches,
                                    launch_overhead_us=config.launch_overhead_us, profile=config.profile.name)
        benchmark.pedantic(lambda: fn(*inputs), rounds=2, iterations=1)
