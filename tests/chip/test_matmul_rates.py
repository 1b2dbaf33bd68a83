"""What the chip's Tensor Engine charges a matmul, by its operands' dtype (Note [Matmul rates]
in device/profiles.py): the published per-chip figures of trn2 and trn3, FP8's double rate,
the dtypes the Tensor Engine does not take priced as converted (with a warning, once), and
the MoE grouped GEMMs counted by their FLOPs."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import adaptive_eager
from adaptive_eager.dispatch import CONTEXT
from subproc import run_python

N = 1024
FLOPS = 2.0 * N**3  # compute-bound at every rate here: the time says the rate
# CPU's FP8 _scaled_mm is a reference loop: 59 s for one 1024^3 product on 2 cores. FP8 products
# of that size are priced in projection mode (adaptive_eager.projection: the shape function runs,
# the price is the same: test_fp8_products_cost_in_projection_what_they_cost_with_bytes), their
# bits compared with CPU's at this size.
SMALL_N = 64


def _op_us(fn, projected: bool = False) -> float:
    with adaptive_eager.mode("eager"), adaptive_eager.projection() if projected else contextlib.nullcontext():
        torch.neuron.synchronize()
        adaptive_eager.reset_stats()
        fn()
        torch.neuron.synchronize()
        s = adaptive_eager.stats()
    return s.device_time_us - s.launch_overhead_us


def _share() -> float:
    cfg = CONTEXT.runtime.config
    return cfg.logical_cores / cfg.profile.neuron_cores_per_chip


def _expected_us(tflops: float) -> float:
    return FLOPS / (tflops * 1e12 * _share()) * 1e6


def _operands(dtype, n: int = N):
    a = torch.randn(n, n).to("neuron")
    b = torch.randn(n, n).to("neuron")
    if dtype.is_floating_point and dtype.itemsize == 1:
        return a.to(dtype), b.t().contiguous().to(dtype).t()  # _scaled_mm wants mat2 column-major
    return a.to(dtype), b.to(dtype)


def _scaled(a, b):
    one = torch.tensor(1.0, device=a.device)
    return torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype, tflops", [(torch.float32, 181), (torch.bfloat16, 667), (torch.float16, 667)])
def test_trn2_prices_a_matmul_at_the_published_rate_of_its_dtype(dtype, tflops):
    a, b = _operands(dtype)
    assert _op_us(lambda: a @ b) == pytest.approx(_expected_us(tflops), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_fp8_products_cost_in_projection_what_they_cost_with_bytes(dtype):
    a, b = _operands(dtype, SMALL_N)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Tensor Engine does not take.*")
        assert _op_us(lambda: _scaled(a, b), projected=True) == _op_us(lambda: _scaled(a, b))


def test_trn2_prices_e5m2_scaled_mm_at_its_dense_fp8_rate():
    a, b = _operands(torch.float8_e5m2)
    assert _op_us(lambda: _scaled(a, b), projected=True) == pytest.approx(_expected_us(1299), rel=1e-6)


def test_trn2_prices_e4m3fn_as_converted_to_bf16_with_cpus_values():
    a, b = _operands(torch.float8_e4m3fn)
    small_a, small_b = _operands(torch.float8_e4m3fn, SMALL_N)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Tensor Engine does not take.*")
        us = _op_us(lambda: _scaled(a, b), projected=True)
        got = _scaled(small_a, small_b).cpu()
    assert us == pytest.approx(_expected_us(667), rel=1e-6)
    assert torch.equal(got, _scaled(small_a.cpu(), small_b.cpu()))  # computed as the CPU computes it


def test_trn2_says_once_that_it_converts_e4m3fn():
    proc = run_python("""
        import warnings, torch, adaptive_eager
        a = torch.randn(64, 64).to(torch.float8_e4m3fn).to("neuron")
        b = torch.randn(64, 64).t().contiguous().to(torch.float8_e4m3fn).t().to("neuron")
        one = torch.tensor(1.0, device="neuron")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
        print(sum("Tensor Engine does not take torch.float8_e4m3fn" in str(w.message) for w in caught))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "1"


def test_trn3_doubles_bf16_for_fp8_and_prices_fp32_and_e4m3fn_natively():
    proc = run_python("""
        import json, torch, adaptive_eager
        N = 1024
        def us(fn):
            with adaptive_eager.mode("eager"):
                torch.neuron.synchronize(); adaptive_eager.reset_stats(); fn(); torch.neuron.synchronize()
                s = adaptive_eager.stats()
            return s.device_time_us - s.launch_overhead_us
        a, b = torch.randn(N, N).to("neuron"), torch.randn(N, N).to("neuron")
        one = torch.tensor(1.0, device="neuron")
        out = {"fp32": us(lambda: a @ b)}
        x, y = a.bfloat16(), b.bfloat16()
        out["bf16"] = us(lambda: x @ y)
        for name, dt in (("e4m3fn", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
            p, q = a.to(dt), b.t().contiguous().to(dt).t()
            with adaptive_eager.projection():  # priced without CPU's minute-long FP8 product
                out[name] = us(lambda: torch._scaled_mm(p, q, one, one, out_dtype=torch.bfloat16))
        print(json.dumps(out))
    """, env={"NEURON_PROFILE": "trn3", "PYTHONWARNINGS": "error"})
    assert proc.returncode == 0, proc.stderr  # no conversion warning on trn3
    got = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    share = 2 / 8
    for key, tflops in (("fp32", 183), ("bf16", 671), ("e4m3fn", 2 * 671), ("e5m2", 2 * 671)):
        assert got[key] == pytest.approx(2.0 * 1024**3 / (tflops * 1e12 * share) * 1e6, rel=1e-6), key
    assert got["bf16"] / got["e4m3fn"] == pytest.approx(2.0)


G, K, M = 4, 1024, 2048


@pytest.mark.parametrize("case", ["2d_3d", "3d_3d", "2d_2d"])
def test_grouped_mm_is_one_launch_counted_by_its_flops_and_gives_cpus_bits(case):
    g = torch.Generator().manual_seed(0)
    if case == "2d_3d":  # rows grouped by offs: the MoE forward
        a, b = torch.randn(M, K, generator=g), torch.randn(G, K, K, generator=g)
        offs, flops = torch.tensor([300, 900, 1500, M], dtype=torch.int32), 2.0 * M * K * K
    elif case == "3d_3d":
        a, b = torch.randn(G, M // 2, K, generator=g), torch.randn(G, K, K, generator=g)
        offs, flops = None, 2.0 * G * (M // 2) * K * K
    else:  # the contraction grouped by offs: the weight gradient
        a, b = torch.randn(K, M, generator=g), torch.randn(M, K, generator=g)
        offs, flops = torch.tensor([512, 1024, 1536, M], dtype=torch.int32), 2.0 * K * M * K
    expect = torch._grouped_mm(a, b, offs=offs)
    cost = CONTEXT.runtime.cost
    nbytes = 4 * (a.numel() + b.numel() + expect.numel())
    compute_us = flops * cost.us_per_flop(torch.float32)
    assert compute_us > 2 * nbytes * cost.us_per_byte  # compute-bound: else the test could not fail
    an, bn = a.to("neuron"), b.to("neuron")
    on = offs.to("neuron") if offs is not None else None
    with adaptive_eager.mode("eager"):
        adaptive_eager.reset_stats()
        got = torch._grouped_mm(an, bn, offs=on)
        s = adaptive_eager.stats()
    assert s.launches == 1  # one grouped GEMM, not one mm per group
    assert s.device_time_us - s.launch_overhead_us == pytest.approx(compute_us, rel=1e-6)
    assert torch.equal(got.cpu(), expect)


def test_scaled_grouped_mm_says_it_has_no_cpu_kernel_and_what_to_use():
    a = torch.randn(16, 16).to(torch.float8_e4m3fn).to("neuron")
    b = torch.randn(3, 8, 16).to(torch.float8_e4m3fn).transpose(-2, -1).to("neuron")
    offs = torch.tensor([5, 10, 16], dtype=torch.int32).to("neuron")
    with pytest.raises(NotImplementedError, match=r"_scaled_grouped_mm has no CPU kernel in torch 2\.13.*"
                                                  r"cannot run on neuron; dequantize .* torch\._grouped_mm"):
        torch._scaled_grouped_mm(a, b, torch.ones(16, device="neuron"), torch.ones(3, 8, device="neuron"), offs=offs,
                                 out_dtype=torch.bfloat16)
