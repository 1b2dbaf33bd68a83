"""What a fused launch of the adaptive engine costs on the modelled chip: its inputs read from
HBM and its outputs written there, the values made and used inside it kept on chip while they
fit in SBUF (Note [On-chip intermediates] in device/cost.py), and the ops the Tensor Engine does
not run bounded by the Vector Engine's rate (Note [The Vector Engine floor])."""
from __future__ import annotations

import pytest
import torch

import adaptive_eager
from adaptive_eager.device import native
from adaptive_eager.device.profiles import PROFILES
from adaptive_eager.dispatch import CONTEXT

N = 1 << 20  # 4 MiB of float32: HBM-bound in eager mode, and small beside SBUF
STEPS = 6  # enough for the engine to trust and replay the step


def _cost():
    return CONTEXT.runtime.cost


def _hbm(nbytes: float) -> float:
    return nbytes * _cost().us_per_byte


def _vector(elements: float, dtype=torch.float32) -> float:
    return elements * _cost().us_per_vector_element(dtype)


def _last_of_steps(mode: str, step):
    """(stats, op log) of the last of STEPS runs of step()."""
    with adaptive_eager.mode(mode):
        for k in range(STEPS):
            torch.neuron.synchronize()
            adaptive_eager.reset_stats()
            native.set_op_log(k == STEPS - 1)
            out = step()
            torch.neuron.synchronize()
            s = adaptive_eager.stats()
            del out
    ops = native.take_op_log()
    native.set_op_log(False)
    return s, ops


def _step_us(mode: str, body, x):
    """(launches, op µs) of the last of STEPS runs of body(x) and a tick: the device time
    without the launch overhead or the tick's."""
    tick = torch.zeros(1, device="neuron")
    s, _ = _last_of_steps(mode, lambda: _step(body, x, tick))
    return s.launches, s.device_time_us - s.launch_overhead_us - _hbm(8)


def _step(body, x, tick):
    out = body(x)
    # The launch is issued as its last op is called, whose inputs the program holds then:
    # ending on this op, the body's values are dead at issue, as at a real step's end.
    tick.add_(1)
    return out


def _chain(x):
    return (((x * 2) + 1) * 3).relu()  # the temporaries die as the expression goes on


def test_a_fused_chain_reads_its_input_and_writes_its_output_once():
    x = torch.randn(N, device="neuron")
    launches, eager_us = _step_us("eager", _chain, x)
    assert launches == 5
    assert eager_us == pytest.approx(4 * _hbm(8 * N))  # each op reads and writes 4 MiB
    launches, fused_us = _step_us("adaptive", _chain, x)
    assert launches == 1
    # the first op reads x from HBM, the next two work on chip, relu writes the result
    expected = max(_hbm(4 * N), _vector(N)) + 2 * _vector(N) + max(_hbm(4 * N), _vector(N))
    assert fused_us == pytest.approx(expected)
    assert fused_us < eager_us / 2


def _keep_first(x):
    a = x * 2
    return a, (a + 1).relu()  # a leaves the launch: the program still holds it


def test_a_value_the_program_still_holds_is_written_to_hbm():
    x = torch.randn(N, device="neuron")
    launches, fused_us = _step_us("adaptive", _keep_first, x)
    assert launches == 1
    # mul reads x and writes a; add reads a from SBUF (it is resident) and streams into relu
    expected = _hbm(8 * N) + _vector(N) + max(_hbm(4 * N), _vector(N))
    assert fused_us == pytest.approx(expected)


def test_the_last_ops_inputs_count_as_held_by_the_program():
    # Without the tick, relu is the launch's last op: called with add's result, which the
    # program holds at issue (an argument of that call), so add writes it to HBM.
    x = torch.randn(N, device="neuron")
    s, _ = _last_of_steps("adaptive", lambda: _chain(x))
    assert s.launches == 1
    expected = max(_hbm(4 * N), _vector(N)) + _vector(N) + 2 * _hbm(4 * N)
    assert s.device_time_us - s.launch_overhead_us == pytest.approx(expected)


def _two_readers(x):
    a = x * 2
    return a + a.exp()  # exp and add both read a: it must stay resident between them


@pytest.mark.parametrize("elements, fits", [(N, True), (20 * N, False)])  # 80 MiB exceed SBUF (56 MiB)
def test_a_value_read_later_stays_in_sbuf_only_if_it_fits(elements, fits):
    assert (4 * elements <= _cost().on_chip_bytes) == fits
    x = torch.randn(elements, device="neuron")
    launches, fused_us = _step_us("adaptive", _two_readers, x)
    assert launches == 1
    if fits:  # exp reads a from SBUF and streams into add, which reads a from SBUF too
        mul = max(_hbm(4 * elements), _vector(elements))
        exp = _vector(elements)
        add = max(_hbm(4 * elements), _vector(2 * elements))
    else:  # a is written to HBM and read back by both
        mul = _hbm(8 * elements)
        exp = max(_hbm(4 * elements), _vector(elements))
        add = max(_hbm(8 * elements), _vector(2 * elements))
    assert fused_us == pytest.approx(mul + exp + add)


def _cast_between(x):
    return (x * 2).to(torch.bfloat16) + 1


def test_a_cast_between_fused_ops_is_their_conversion_not_a_pass_of_its_own():
    x = torch.randn(N, device="neuron")
    launches, fused_us = _step_us("adaptive", _cast_between, x)
    assert launches == 1
    mul = max(_hbm(4 * N), _vector(N))
    add = max(_hbm(2 * N), _vector(N, torch.bfloat16))  # writes bf16 to HBM
    assert fused_us == pytest.approx(mul + add)


def test_the_vector_engine_bounds_an_op_that_moves_few_bytes_per_element():
    x = torch.randint(-100, 100, (N,), dtype=torch.int8, device="neuron")
    launches, us = _step_us("eager", torch.amax, x)
    assert launches == 2
    assert _vector(N, torch.int8) > _hbm(N)  # else the test could not fail
    assert us == pytest.approx(_vector(N, torch.int8))


def test_the_vector_engine_is_widest_for_the_dtypes_its_guide_names():
    trn2, trn3 = PROFILES["trn2"], PROFILES["trn3"]
    assert trn2.vector_elements_per_s(torch.bfloat16) == 512 * 0.96e9
    assert trn2.vector_elements_per_s(torch.float8_e4m3fn) == 256 * 0.96e9
    assert trn2.vector_elements_per_s(torch.float32) == 256 * 0.96e9
    assert trn3.vector_elements_per_s(torch.float8_e4m3fn) == 512 * 1.2e9
    assert trn3.vector_elements_per_s(torch.float32) == 256 * 1.2e9


def test_the_op_log_says_where_a_fused_launchs_time_goes():
    x = torch.randn(N, device="neuron")
    tick = torch.zeros(1, device="neuron")
    s, ops = _last_of_steps("adaptive", lambda: _step(_chain, x, tick))
    assert s.launches == 1
    assert [name for name, _ in ops] == ["aten::mul", "aten::add", "aten::mul", "aten::relu", "aten::add_"]
    assert ops[1][1] == pytest.approx(_vector(N))  # on chip: the Vector Engine's time alone
    assert sum(us for _, us in ops) == pytest.approx(s.device_time_us - s.launch_overhead_us)


def _through_the_host(x):
    # linalg_inv_ex is one of the ops TorchNeuron runs on the host: what it reads must be in
    # HBM to go there, and what it returns comes back into HBM
    return torch.ops.aten.linalg_inv_ex.default(x + 1.0)[0] * 2.0


def test_a_value_a_host_run_op_reads_or_returns_goes_through_hbm_in_a_fused_launch():
    # Note [Ops TorchNeuron runs on the host] (device/csrc/aten/pricing.cpp)
    x = (torch.randn(256, 256) + 256 * torch.eye(256)).to("neuron")
    eager, eager_ops = _last_of_steps("eager", lambda: _through_the_host(x))
    adaptive, adaptive_ops = _last_of_steps("adaptive", lambda: _through_the_host(x))
    assert adaptive.launches == 1 and adaptive.transfers == eager.transfers == 2
    # the add writes its result to HBM and the mul reads the inverse from there, as in eager
    # mode; in SBUF, the add's write and the mul's read would be free
    assert [name for name, _ in adaptive_ops] == [name for name, _ in eager_ops] == ["aten::add", "aten::mul"]
    assert [us for _, us in adaptive_ops] == pytest.approx([us for _, us in eager_ops], rel=1e-12)
