"""Tensors on `neuron`: factories, moves, modules, views and in-place updates, host reads,
device checks, counters, and checkpoints."""
import io
import multiprocessing
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

import adaptive_eager
from neuron_tensors import is_neuron_tensor
from subproc import run_json

NEURON0 = torch.device("neuron:0")


def _same(a, b) -> bool:
    """Equal values, dtypes and shapes (compared on the host)."""
    a = a.cpu() if a.device.type != "cpu" else a
    b = b.cpu() if b.device.type != "cpu" else b
    return a.dtype == b.dtype and torch.equal(a, b)


# -- factories ------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda d: torch.zeros(2, 3, device=d),
    lambda d: torch.ones(2, 3, dtype=torch.float64, device=d),
    lambda d: torch.full((2, 2), 7, device=d),
    lambda d: torch.arange(1, 10, 2, device=d),
    lambda d: torch.linspace(0, 1, 5, device=d),
    lambda d: torch.eye(3, device=d),
    lambda d: torch.tensor([[1, 2], [3, 4]], device=d),
    lambda d: torch.as_tensor([1.5, 2.5], device=d),
    lambda d: torch.zeros_like(torch.ones(3), device=d),
], ids=["zeros", "ones", "full", "arange", "linspace", "eye", "tensor", "as_tensor", "zeros_like"])
def test_factories_on_neuron_match_cpu(make):
    t = make("neuron")
    assert is_neuron_tensor(t)
    assert _same(t, make("cpu"))


def test_empty_has_the_requested_metadata_and_device():
    t = torch.empty(2, 3, dtype=torch.float16, device="neuron:1")
    assert (t.shape, t.dtype, t.device) == ((2, 3), torch.float16, torch.device("neuron:1"))


@pytest.fixture
def deterministic():
    """torch.use_deterministic_algorithms(True) for the test, the settings restored after."""
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    torch.utils.deterministic.fill_uninitialized_memory = previous[2]


EMPTIES = {
    "empty": lambda d: torch.empty(3, 4, device=d),
    "empty-int32": lambda d: torch.empty(5, dtype=torch.int32, device=d),
    "empty-bfloat16": lambda d: torch.empty(5, dtype=torch.bfloat16, device=d),
    "empty-complex64": lambda d: torch.empty(3, dtype=torch.complex64, device=d),
    "empty_like": lambda d: torch.empty_like(torch.ones(2, 3, device=d).t()),
    "empty_strided": lambda d: torch.empty_strided((2, 3), (1, 2), dtype=torch.int64, device=d),
    "new_empty": lambda d: torch.ones(2, device=d).new_empty(6),
    "new_empty_strided": lambda d: torch.ones(2, device=d).new_empty_strided((2, 2), (1, 2)),
}


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_empty_tensors_under_deterministic_algorithms_are_filled_as_on_cpu(deterministic, mode):
    # Note [Deterministic empty]: NaN for floating and complex dtypes, the largest integer else;
    # neuron returned leftover bytes. Four rounds: adaptive mode records, detects and replays.
    adaptive_eager.set_mode(mode)
    for _ in range(4):
        torch.full((64,), 5.0, device="neuron").add_(1)  # bytes left over for the next allocations
        for name, make in EMPTIES.items():
            expected, got = make("cpu"), make("neuron")
            assert got.stride() == expected.stride(), name
            torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0, equal_nan=True, msg=name)


def test_empty_under_deterministic_algorithms_fills_nothing_when_the_fill_is_turned_off(deterministic):
    # 64 MiB: beyond malloc's largest mmap threshold, so unfilled bytes are fresh pages, zeros.
    torch.utils.deterministic.fill_uninitialized_memory = False
    assert not torch.empty(16 << 20, device="neuron").isnan().any().item()  # as CPU: left as they were
    torch.utils.deterministic.fill_uninitialized_memory = True
    assert torch.empty(16 << 20, device="neuron").isnan().all().item()


@pytest.mark.parametrize("draw", [
    lambda: torch.rand(4, device="neuron"),
    lambda: torch.randn(4, device="neuron"),
    lambda: torch.randint(0, 100, (4,), device="neuron"),
], ids=["rand", "randn", "randint"])
def test_random_factories_are_reproducible_with_the_same_seed(draw):
    torch.manual_seed(123)
    a = draw()
    b = draw()
    torch.manual_seed(123)
    assert _same(draw(), a)
    assert not torch.equal(a.cpu(), b.cpu())


def test_factory_on_a_device_that_does_not_exist_names_the_valid_range():
    # torch.AcceleratorError, as CUDA's invalid device ordinal, from the C++ guard (native
    # tensors) and from the runtime (NeuronDeviceIndexError) alike (test_device_api.py).
    with pytest.raises(torch.AcceleratorError, match=r"Invalid device: neuron:9\. .*must be in \[0, "):
        torch.ones(1, device="neuron:9")


# -- moving tensors and modules ---------------------------------------------------------------
def test_to_neuron_and_dot_neuron_copy_the_value_as_one_transfer_each():
    x = torch.arange(6.0).view(2, 3)
    a = x.to("neuron")
    b = x.neuron()
    s = adaptive_eager.stats()
    assert a.device == b.device == NEURON0
    assert _same(a, x) and _same(b, x)
    assert (s.transfers, s.launches, s.transfer_bytes) == (2, 0, 48)


def test_moving_between_devices_is_a_transfer_not_a_launch():
    a = torch.arange(4.0, device="neuron")
    adaptive_eager.reset_stats()
    b = a.to("neuron:1")
    s0, s1 = adaptive_eager.stats(0), adaptive_eager.stats(1)
    assert (s0.launches + s1.launches, s0.transfers + s1.transfers) == (0, 1)
    assert b.device == torch.device("neuron:1") and _same(b, a)
    b.add_(1)  # b has its own bytes
    assert _same(a, torch.arange(4.0))


def test_a_later_change_of_the_cpu_source_does_not_reach_the_device_copy():
    x = torch.zeros(3)
    y = x.to("neuron")
    x.add_(1)
    assert _same(y, torch.zeros(3))


@pytest.mark.parametrize("move", [lambda m: m.to("neuron"), lambda m: m.neuron()], ids=["to", "neuron"])
def test_module_moves_to_neuron_and_computes_the_cpu_result(move):
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected = m(x)
    moved = move(m)
    assert moved is m
    assert all(p.device == NEURON0 for p in m.parameters())
    assert isinstance(m.weight, torch.nn.Parameter)
    out = m(x.to("neuron"))
    assert out.device == NEURON0
    assert torch.allclose(out.cpu(), expected)


# -- views and in-place updates -----------------------------------------------------------------
def test_in_place_through_a_slice_changes_the_base():
    x = torch.zeros(4, device="neuron")
    x[1:].add_(1)
    assert x.tolist() == [0.0, 1.0, 1.0, 1.0]


def test_views_alias_their_base_on_the_device():
    x = torch.arange(6.0, device="neuron")
    v = x.view(2, 3)
    t = v.t()
    assert (t.shape, t.stride()) == ((3, 2), (1, 3))
    t[0, 1] = 100.0  # writes v[1, 0], which is x[3]
    assert x[3].item() == 100.0
    c = v.transpose(0, 1).contiguous()
    assert c.is_contiguous() and c.stride() == (2, 1)
    c.zero_()  # a copy: the base keeps its values
    assert x.sum().item() == 0 + 1 + 2 + 100 + 4 + 5


def test_in_place_view_ops_update_the_tensor_metadata():
    x = torch.arange(6.0, device="neuron").view(2, 3)
    x.unsqueeze_(0)
    assert x.shape == (1, 2, 3)
    x.squeeze_(0)
    x.t_()
    assert (x.shape, x.stride()) == ((3, 2), (1, 3))
    assert x.tolist() == [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
    x.transpose_(0, 1)
    assert _same(x + 0, torch.arange(6.0).view(2, 3))


def test_resize_grows_the_tensor_and_counts_its_new_bytes():
    x = torch.ones(2, device="neuron")
    before = torch.neuron.memory_allocated()
    x.resize_(2, 5)
    assert x.shape == (2, 5) and x.stride() == (5, 1)
    assert torch.neuron.memory_allocated() == before - 8 + 40
    x.fill_(3)
    assert x.sum().item() == 30.0


def test_out_argument_is_resized_and_returned_as_itself():
    a = torch.ones(3, device="neuron")
    c = torch.empty(0, device="neuron")
    before = torch.neuron.memory_allocated()
    r = torch.add(a, a, out=c)
    assert r is c
    assert c.shape == (3,)
    assert torch.neuron.memory_allocated() == before + 12  # c's storage grew on the device
    assert c.tolist() == [2.0, 2.0, 2.0]


# -- host reads -------------------------------------------------------------------------------
def test_repr_shows_the_device_and_grad_fn():
    x = torch.ones(2, device="neuron", requires_grad=True)
    assert repr(torch.arange(3.0, device="neuron")) == "tensor([0., 1., 2.], device='neuron:0')"
    assert repr(x * 2) == "tensor([2., 2.], device='neuron:0', grad_fn=<MulBackward0>)"
    assert str(torch.zeros(1, device="neuron:1")) == "tensor([0.], device='neuron:1')"


def test_tensor_from_python_data_is_one_host_to_device_transfer():
    # torch.tensor copies with the Python key excluded: it reaches the PrivateUse1 _copy_from
    t = torch.tensor([[1.0, 2.0]], device="neuron:1")
    s = adaptive_eager.stats()
    assert (s.transfers, s.transfer_bytes) == (1, 8)
    assert t.device == torch.device("neuron:1") and t.tolist() == [[1.0, 2.0]]


def test_format_of_a_zero_dim_tensor_uses_its_value():
    assert format(torch.tensor(1.23456, device="neuron"), ".3f") == "1.235"
    assert f"{torch.ones(3, device='neuron').sum():.1f}" == "3.0"


def test_scalar_and_list_reads():
    x = torch.arange(6.0, device="neuron").view(2, 3)
    assert x[1, 2].item() == 5.0
    assert x.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert bool(x[0, 1]) is True and bool(x[0, 0]) is False
    assert float(x[1, 0]) == 3.0 and int(x[1, 1]) == 4
    assert torch.equal(x, x.clone()) and not torch.equal(x, x + 1)


def test_cpu_returns_a_real_cpu_tensor_that_does_not_alias_the_device():
    x = torch.arange(3.0, device="neuron")
    h = x.cpu()
    assert type(h) is torch.Tensor and h.device.type == "cpu"
    h.add_(10)
    assert x.tolist() == [0.0, 1.0, 2.0]


def test_numpy_raises_like_cuda_and_cpu_numpy_works():
    x = torch.arange(3.0, device="neuron")
    with pytest.raises(TypeError, match=r"can't convert neuron:0 device type tensor to numpy\. Use Tensor\.cpu\(\)"):
        x.numpy()
    assert x.cpu().numpy().tolist() == [0.0, 1.0, 2.0]


def test_iterating_yields_rows_on_the_device():
    x = torch.arange(6.0, device="neuron").view(3, 2)
    rows = [row for row in x]
    assert len(rows) == 3 and all(r.device == NEURON0 for r in rows)
    assert [r.tolist() for r in rows] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


# -- device checks ------------------------------------------------------------------------------
def test_ops_across_two_neuron_devices_are_rejected():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*neuron:0 and neuron:1"):
        torch.ones(2, device="neuron:0") + torch.ones(2, device="neuron:1")


def test_ops_mixing_neuron_and_a_cpu_tensor_are_rejected():
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device.*neuron:0 and cpu"):
        torch.ones(2, device="neuron") + torch.ones(2)


def test_a_cpu_zero_dim_tensor_is_a_scalar_operand():
    y = torch.ones(2, device="neuron") + torch.tensor(2.0)
    assert y.device == NEURON0 and y.tolist() == [3.0, 3.0]


# -- counters ------------------------------------------------------------------------------------
def test_each_op_is_one_launch_and_host_reads_are_transfers():
    x = torch.ones(4, device="neuron")
    adaptive_eager.reset_stats()
    y = (x + 1) * 2
    y.add_(1)
    s = adaptive_eager.stats()
    assert (s.ops, s.launches, s.transfers) == (3, 3, 0)
    y.cpu()
    y.sum().item()
    s = adaptive_eager.stats()
    assert (s.launches, s.transfers) == (4, 2)


# -- checkpoints ---------------------------------------------------------------------------------
def _saved(obj) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2).to("neuron")


def test_state_dict_loads_with_weights_only_back_on_neuron(model):
    sd = torch.load(_saved(model.state_dict()), weights_only=True)
    assert set(sd) == {"weight", "bias"}
    for name, value in sd.items():
        assert is_neuron_tensor(value)
        assert _same(value, getattr(model, name))


def test_state_dict_loads_on_cpu_as_plain_cpu_tensors(model):
    sd = torch.load(_saved(model.state_dict()), weights_only=True, map_location="cpu")
    for name, value in sd.items():
        assert type(value) is torch.Tensor and value.device.type == "cpu"
        assert _same(value + 0, getattr(model, name))  # ops on it run on the CPU


def test_state_dict_round_trips_into_a_fresh_neuron_model(model):
    fresh = torch.nn.Linear(3, 2).to("neuron")
    fresh.load_state_dict(torch.load(_saved(model.state_dict()), weights_only=True, map_location="cpu"))
    assert is_neuron_tensor(fresh.weight)
    assert _same(fresh.weight, model.weight) and _same(fresh.bias, model.bias)


def test_a_saved_parameter_loads_as_a_parameter(model):
    p = torch.load(_saved(model.weight), weights_only=True)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad and p.device == NEURON0
    assert _same(p, model.weight)


def test_optimizer_state_dict_round_trips(model):
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4, 3, device="neuron")).sum().backward()
    opt.step()
    state = torch.load(_saved(opt.state_dict()), weights_only=True)
    exp_avg = state["state"][0]["exp_avg"]
    assert exp_avg.device == NEURON0
    assert _same(exp_avg, opt.state[model.weight]["exp_avg"])
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["lr"] == 0.1
    assert _same(fresh.state[model.weight]["exp_avg_sq"], opt.state[model.weight]["exp_avg_sq"])


# map_location='neuron' once reached torch.UntypedStorage(n, device='neuron'), which
# segfaults: run it in a fresh process so a regression cannot kill the test session.
_LOAD_MAP_NEURON = """
    import io, torch
    m = torch.nn.Linear(3, 2).to('neuron:1')
    buf = io.BytesIO(); torch.save(m.state_dict(), buf)
    out = {}
    for loc in ['neuron', 'neuron:2', 'dict']:
        buf.seek(0)
        ml = {'neuron:1': 'neuron:3'} if loc == 'dict' else loc
        sd = torch.load(buf, weights_only=True, map_location=ml)
        out[loc] = [str(sd['weight'].device), torch.equal(sd['weight'].cpu(), m.weight.cpu())]
    emit(out)
"""


def test_load_with_map_location_neuron_is_safe_and_honours_the_index():
    r = run_json(_LOAD_MAP_NEURON)
    assert r == {"neuron": ["neuron:0", True], "neuron:2": ["neuron:2", True],
                 "dict": ["neuron:3", True]}


# -- other processes: Note [Neuron tensors stay in their process] (dispatch/sharing.py) ---------------
@pytest.mark.parametrize("send", [
    lambda obj: ForkingPickler.dumps(obj),  # what a multiprocessing Queue's put does
    lambda obj: multiprocessing.get_context("spawn").Process(target=print, args=(obj,)).start(),
], ids=["queue", "spawn-args"])
@pytest.mark.parametrize("make", [
    lambda: torch.ones(3, device="neuron"),
    lambda: torch.nn.Parameter(torch.ones(3, device="neuron")),
    lambda: torch.ones(3, device="neuron").untyped_storage(),
], ids=["tensor", "parameter", "storage"])
def test_sending_a_neuron_tensor_to_another_process_says_to_send_a_cpu_tensor(make, send):
    # torch's reducer took it for a CPU tensor: "_share_fd_: only available on CPU", no hint.
    with pytest.raises(RuntimeError, match=r"Cannot send a neuron (tensor|storage) to another process.*"
                       r"Move it to the CPU before sending.*\.to\('neuron'\) in the receiving process"):
        send(make())


def test_a_cpu_tensor_still_goes_to_another_process_through_shared_memory():
    rebuild, args = ForkingPickler._extra_reducers[torch.Tensor](torch.ones(3))
    assert callable(rebuild) and args  # torch's own reducer: shared memory, no copy through the pipe


# -- layouts: neuron tensors are dense (Note [Dense layouts only] in device/csrc/aten/layouts.cpp) --
_DENSE = torch.eye(3)
_CSR_PARTS = (torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 2]), torch.ones(3))


@pytest.mark.parametrize("make", [
    lambda: _DENSE.to_sparse().to("neuron"),
    lambda: _DENSE.to_sparse_csr().to("neuron"),
    lambda: _DENSE.to_sparse_csc().to("neuron"),
    lambda: _DENSE.to_sparse_bsr((1, 1)).to("neuron"),
    lambda: torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.ones(2), (2, 2), device="neuron"),
    lambda: torch.sparse_csr_tensor(*_CSR_PARTS, device="neuron"),
    lambda: torch.sparse_csr_tensor(*(p.to("neuron") for p in _CSR_PARTS)),
    lambda: torch.sparse_compressed_tensor(*_CSR_PARTS, (3, 3), layout=torch.sparse_csr, device="neuron"),
    lambda: torch.eye(3, device="neuron").to_sparse(),
    lambda: torch.eye(3, device="neuron").to_sparse_csr(),
], ids=["coo.to", "csr.to", "csc.to", "bsr.to", "coo-factory", "csr-factory", "csr-of-neuron-parts",
        "compressed-factory", "to_sparse-on-neuron", "to_sparse_csr-on-neuron"])
def test_a_sparse_tensor_is_refused_where_it_would_be_made(make):
    # Made, it failed at every op (.cpu() included) with "Could not run ... 'SparseCsrneuron'".
    with pytest.raises(NotImplementedError, match=r"dense \(strided\) only.*sparse.*on the CPU"):
        make()


# Note [No quantized tensors] (device/csrc/aten/layouts.cpp): refused where made, with the way out.
_X = torch.linspace(-1, 1, 6)


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("make", [
    lambda: torch.quantize_per_tensor(_X.to("neuron"), 0.1, 0, torch.qint8),
    lambda: torch.quantize_per_tensor(_X.to("neuron"), torch.tensor(0.1), torch.tensor(0), torch.quint8),
    lambda: torch.quantize_per_tensor_dynamic(_X.to("neuron"), torch.qint8, False),
    lambda: torch.quantize_per_channel(_X.view(2, 3).to("neuron"), torch.tensor([0.1, 0.2]),
                                       torch.tensor([0, 0]), 0, torch.qint8),
    lambda: torch.quantize_per_tensor(_X, 0.1, 0, torch.qint8).to("neuron"),
    lambda: torch._empty_affine_quantized((2,), scale=0.1, zero_point=0, dtype=torch.quint8, device="neuron"),
    lambda: torch.empty(2, dtype=torch.qint8, device="neuron"),
], ids=["per_tensor", "per_tensor-tensor-qparams", "dynamic", "per_channel", "quantized.to", "empty_affine",
        "empty-qint8"])
def test_a_quantized_tensor_is_refused_where_it_would_be_made_saying_what_to_do(make, mode):
    # Before: quantize_per_tensor on neuron gave a qint8 tensor with is_quantized False, whose
    # every use (.cpu(), int_repr, print) then failed with CPU's errors and no way out.
    adaptive_eager.set_mode(mode)
    with pytest.raises(NotImplementedError, match=r"neuron has no quantized tensors.*"
                       r"Quantize on the CPU.*torchao's quantization"):
        for _ in range(4):  # adaptive mode: again once the engine has seen the op
            made = make()
            made.cpu()


def test_fake_quantization_stays_a_plain_neuron_tensor_equal_to_cpus():
    # Quantization-aware training's fake quantize makes no quantized tensor: it still runs.
    out = torch.fake_quantize_per_tensor_affine(_X.to("neuron"), 0.1, 0, -128, 127)
    assert not out.is_quantized and out.device.type == "neuron"
    assert torch.equal(out.cpu(), torch.fake_quantize_per_tensor_affine(_X, 0.1, 0, -128, 127))


def test_a_strided_nested_tensor_is_refused_with_the_jagged_layout_as_the_way():
    refused = pytest.raises(NotImplementedError, match=r"dense \(strided\) only.*nested.*layout=torch.jagged")
    parts = [torch.ones(2), torch.ones(3)]
    with refused:
        torch.nested.nested_tensor(parts).to("neuron")
    with refused:
        torch.nested.as_nested_tensor([p.to("neuron") for p in parts])
    # torch.nested.nested_tensor(..., device=) builds it below the dispatcher (no op of ours is
    # asked): that one is refused at its first use, every op and .cpu() alike.
    made = torch.nested.nested_tensor(parts, device="neuron")
    with refused:
        made.cpu()
    with refused:
        made + 1


def test_a_jagged_nested_tensor_runs_on_neuron_as_on_cpu():
    parts = [torch.arange(2.0), torch.arange(3.0)]
    on_cpu = torch.nested.nested_tensor(parts, layout=torch.jagged)
    on_neuron = torch.nested.nested_tensor(parts, layout=torch.jagged, device="neuron")
    assert on_neuron.device == NEURON0
    got, expected = (on_neuron.sin() * 2).cpu(), on_cpu.sin() * 2
    assert all(torch.equal(a, b) for a, b in zip(got.unbind(), expected.unbind()))
