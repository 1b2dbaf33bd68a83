"""The modelled time of NKI kernels (device/nki/costs.py, timeline.py): per-engine instruction
costs from the architecture guides, engines overlapping where dependences allow, and the
profile a user reads (per-engine busy time, a Perfetto/chrome trace)."""
from __future__ import annotations

import json

import pytest
import torch

import adaptive_eager.nki as nki
import adaptive_eager.nki.isa as nisa
import adaptive_eager.nki.language as nl
from adaptive_eager.device.nki import costs


def _tile(shape, dtype=nl.float32):
    t = nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    return t


@nki.jit
def one_matmul(x, n, dtype):
    a, b = _tile((128, 128), dtype), _tile((128, n), dtype)
    res = nl.ndarray((128, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=a, moving=b)


def _busy(profile, engine):
    return profile.busy_us[engine]


def test_a_float32_matmul_costs_four_times_a_bfloat16_one():
    bf16 = nki.profile(one_matmul, torch.zeros(1), 512, nl.bfloat16)
    fp32 = nki.profile(one_matmul, torch.zeros(1), 512, nl.float32)
    assert _busy(bf16, "tensor") == pytest.approx(512 / 2.4 / 1000)  # one moving column per cycle at 2.4 GHz
    assert _busy(fp32, "tensor") == pytest.approx(4 * _busy(bf16, "tensor"))


def test_a_short_matmul_costs_the_initiation_latency():
    short = nki.profile(one_matmul, torch.zeros(1), 8, nl.bfloat16)
    assert _busy(short, "tensor") == pytest.approx(64 / 2.4 / 1000)


@nki.jit
def independent(x):
    """A matmul and an activation that share nothing: they run on two engines at once."""
    c = _tile((128, 2048))
    a, b = _tile((128, 128), nl.bfloat16), _tile((128, 512), nl.bfloat16)
    res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=a, moving=b)
    out = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=out, op=nl.exp, data=c)


@nki.jit
def dependent(x):
    """The activation reads the matmul's result: it waits for it."""
    a, b = _tile((128, 128), nl.bfloat16), _tile((128, 512), nl.bfloat16)
    res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=res, stationary=a, moving=b)
    out = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=out, op=nl.exp, data=res)


def _instrs(profile, name):
    return [i for i in profile.timeline.instrs if i.name == name]


def test_engines_overlap_independent_instructions_and_serialise_dependent_ones():
    p = nki.profile(independent, torch.zeros(1))
    mm, act = _instrs(p, "nc_matmul")[0], _instrs(p, "activation")[0]
    assert act.start < mm.end and mm.start < act.end  # Scalar and Tensor Engine busy at once
    q = nki.profile(dependent, torch.zeros(1))
    mm, act = _instrs(q, "nc_matmul")[0], _instrs(q, "activation")[0]
    assert act.start >= mm.end


def test_vector_results_are_visible_a_hundred_cycles_after_the_instruction():
    @nki.jit
    def chain(x):
        t = _tile((128, 8))
        for _ in range(4):
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)

    p = nki.profile(chain, torch.zeros(1))
    adds = _instrs(p, "tensor_scalar")
    cycle = 1 / 0.96  # ns per Vector Engine cycle on trn2
    for prev, nxt in zip(adds, adds[1:]):
        assert nxt.start == pytest.approx(prev.end + 100 * cycle)
    assert adds[0].ns == pytest.approx(64 * cycle)  # 8 elements: the minimum initiation interval


def test_the_bfloat16_vector_performance_mode_quadruples_a_copy():
    @nki.jit
    def copies(x, dtype):
        src = _tile((128, 4096), dtype)
        dst = nl.ndarray((128, 4096), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=dst, src=src)

    fp32 = _instrs(nki.profile(copies, torch.zeros(1), nl.float32), "tensor_copy")[0].ns
    bf16 = _instrs(nki.profile(copies, torch.zeros(1), nl.bfloat16), "tensor_copy")[0].ns
    assert fp32 == pytest.approx(4 * bf16)


@nki.jit
def load(x):
    t = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)


def test_a_dma_spreads_over_one_engine_per_eight_partitions_and_pays_the_start_latency():
    wide = _instrs(nki.profile(load, torch.zeros(128, 1024)), "dma_copy")[0]
    narrow = _instrs(nki.profile(load, torch.zeros(8, 16 * 1024)), "dma_copy")[0]
    row_eff = 4096 / (4096 + 200)
    assert (wide.engines, narrow.engines) == (16, 1)
    assert wide.ns == pytest.approx(128 * 4096 / (16 * 23.0 * row_eff))
    assert narrow.ns == pytest.approx(16 * wide.ns * (64 * 1024 / (64 * 1024 + 200)) ** -1 * row_eff)
    assert wide.latency_ns == 1300.0


def test_small_dma_rows_are_overhead_bound():
    small = _instrs(nki.profile(load, torch.zeros(128, 16)), "dma_copy")[0]  # 64 bytes a row
    big = _instrs(nki.profile(load, torch.zeros(128, 1024)), "dma_copy")[0]
    per_byte_small, per_byte_big = small.ns / (128 * 64), big.ns / (128 * 4096)
    assert per_byte_small > 3 * per_byte_big


def test_trn3_moves_dma_bytes_at_33_bytes_per_ns(monkeypatch):
    trn2 = _instrs(nki.profile(load, torch.zeros(128, 1024)), "dma_copy")[0].ns
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn3")
    trn3 = _instrs(nki.profile(load, torch.zeros(128, 1024)), "dma_copy")[0].ns
    assert trn2 / trn3 == pytest.approx(33 / 23)


def test_a_kernel_that_allocates_psum_in_a_loop_never_runs_out_while_profiled():
    @nki.jit
    def many(x):
        a, b = _tile((128, 128), nl.bfloat16), _tile((128, 512), nl.bfloat16)
        acc = _tile((128, 512))
        for _ in range(20):  # 20 PSUM tiles over time, never more than two alive
            res = nl.ndarray((128, 512), dtype=nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=res, stationary=a, moving=b)
            nisa.tensor_tensor(dst=acc, data1=acc, data2=res, op=nl.add)

    assert nki.profile(many, torch.zeros(1)).counts["nc_matmul"] == 20


def test_the_profile_reports_busy_time_per_engine_and_exports_a_trace_per_engine(tmp_path):
    p = nki.profile(independent, torch.zeros(1))
    assert p.total_us == pytest.approx(max(i.visible for i in p.timeline.instrs) / 1000)
    assert set(p.busy_us) == set(costs.ENGINES)
    assert 0 < p.utilization["tensor"] <= 1 and 0 < p.utilization["scalar"] <= 1
    path = tmp_path / "trace.json"
    p.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert {"core0.tensor", "core0.scalar", "core0.vector"} <= tracks
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == p.instructions
    assert "tensor" in repr(p) and "us modelled" in repr(p)


def test_programs_of_an_lnc2_launch_run_on_two_cores_at_once():
    @nki.jit
    def halves(x):
        i = nl.program_id(0)
        t = nl.ndarray((128, 2048), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])

    one = nki.profile(halves, torch.zeros(256, 2048))
    two = nki.profile(halves[2], torch.zeros(256, 2048))
    assert {i.core for i in two.timeline.instrs} == {0, 1}
    assert two.total_us == pytest.approx(one.total_us)  # twice the work, two cores, the same time
