"""OpRecord signatures and the op-stream recorder."""
import os
import sys
import threading

import pytest
import torch

from adaptive_eager.engine.record import OpRecord, OpRecorder, Slot, record_ops

aten = torch.ops.aten


def sig(func, *args, **kwargs):
    return OpRecord.from_call(func, args, kwargs).signature


@pytest.fixture(params=["cpu", "neuron"])
def device(request):
    return request.param


# -- signatures ---------------------------------------------------------------------------------

def test_float_scalars_are_lifted_so_lr_changes_keep_the_signature(device):
    p, g = torch.randn(4, 3, device=device), torch.randn(4, 3, device=device)
    a = OpRecord.from_call(aten.add_.Tensor, (p, g), {"alpha": -0.1})
    b = OpRecord.from_call(aten.add_.Tensor, (p, g), {"alpha": -0.2})
    assert a.signature == b.signature
    assert hash(a.signature) == hash(b.signature)
    assert a.values[-1] == -0.1 and b.values[-1] == -0.2


def test_float_passed_where_schema_says_tensor_is_lifted(device):
    x = torch.randn(5, device=device)
    assert sig(aten.div.Tensor, x, 0.0547) == sig(aten.div.Tensor, x, 0.91)


def test_float_lists_are_lifted_elementwise(device):
    xs = [torch.randn(3, device=device), torch.randn(2, device=device)]
    assert sig(aten._foreach_div_.ScalarList, xs, [0.1, 0.2]) == sig(aten._foreach_div_.ScalarList, xs, [0.3, 0.4])


def test_int_and_float_scalars_differ(device):
    x = torch.randn(5, device=device)
    assert sig(aten.add.Tensor, x, 1) != sig(aten.add.Tensor, x, 1.0)


def test_structural_ints_and_bools_are_keyed_by_value(device):
    x = torch.randn(4, 6, device=device)
    assert sig(aten.sum.dim_IntList, x, [0], True) != sig(aten.sum.dim_IntList, x, [1], True)
    assert sig(aten.sum.dim_IntList, x, [0], True) != sig(aten.sum.dim_IntList, x, [0], False)
    # True == 1 in Python; the key must still tell a bool from an int.
    assert sig(aten.add.Tensor, x, True) != sig(aten.add.Tensor, x, 1)


def test_shape_stride_offset_and_dtype_change_the_signature(device):
    x = torch.randn(4, 6, device=device)
    base = sig(aten.neg.default, x)
    assert sig(aten.neg.default, torch.randn(4, 6, device=device)) == base  # other data, same metadata
    assert sig(aten.neg.default, torch.randn(6, 4, device=device)) != base  # shape
    assert sig(aten.neg.default, torch.randn(6, 4, device=device).t()) != base  # same shape, strides
    assert sig(aten.neg.default, torch.randn(25, device=device)[1:].view(4, 6)) != base  # offset
    assert sig(aten.neg.default, x.double()) != base  # dtype
    assert sig(aten.neg.default, x.cpu() if device == "neuron" else x.to("neuron")) != base  # device


def test_cpu_scalar_tensor_is_read_at_issue_time_and_keyed_by_dtype_only():
    x = torch.randn(3, device="neuron")
    step = torch.tensor(3.0)
    rec = OpRecord.from_call(aten.mul.Tensor, (x, step), {})
    step += 1  # a later change must not reach the recorded value
    assert rec.values[1].item() == 3.0
    assert rec.signature == sig(aten.mul.Tensor, x, torch.tensor(7.0))
    assert rec.signature != sig(aten.mul.Tensor, x, torch.tensor(7.0, dtype=torch.float64))


def test_written_cpu_scalar_tensor_stays_the_tensor_itself():
    step = torch.tensor(3.0)
    rec = OpRecord.from_call(aten.add_.Tensor, (step, 1), {})
    assert rec.values[0] is step


def test_template_rebinds_to_new_values(device):
    p, g = torch.randn(4, device=device), torch.randn(4, device=device)
    rec = OpRecord.from_call(aten.add.Tensor, (p, g), {"alpha": 0.5})
    assert isinstance(rec.args[0], Slot) and isinstance(rec.kwargs["alpha"], Slot)
    q = torch.randn(4, device=device)
    args, kwargs = rec.bind((q, g, 2.0))
    assert args[0] is q and args[1] is g and kwargs == {"alpha": 2.0}
    assert torch.equal(rec.func(*args, **kwargs).cpu(), (q + 2.0 * g).cpu())
    args, kwargs = rec.bind()  # the recorded call itself
    assert args[0] is p and kwargs["alpha"] == 0.5


def test_source_is_only_captured_on_request():
    x = torch.randn(2)
    assert OpRecord.from_call(aten.neg.default, (x,), {}).source is None
    rec = OpRecord.from_call(aten.neg.default, (x,), {}, source=True); line = sys._getframe().f_lineno  # noqa: E702
    assert rec.source.endswith(f"test_record.py:{line} in test_source_is_only_captured_on_request")


# -- the recorder ---------------------------------------------------------------------------------

def _tiny_step(device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8, device=device)
    y = torch.randint(0, 4, (5,), device=device)
    return model, opt, x, y


def test_recorder_lists_forward_backward_and_optimizer_ops(device):
    model, opt, x, y = _tiny_step(device)
    with record_ops() as rec:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    names = rec.names()
    assert names.count("aten.addmm.default") == 2  # forward: two Linear layers
    assert "aten.threshold_backward.default" in names  # ReLU's backward
    assert names.count("aten.mm.default") >= 3  # weight and input gradients
    assert any(n.startswith("aten._foreach_add_") or n == "aten.add_.Tensor" for n in names)
    assert names.index("aten.threshold_backward.default") > names.index("aten.nll_loss_forward.default")
    text = str(rec)
    assert "aten.addmm.default" in text and "f32[5, 8]" in text


def test_recorder_sees_factories_and_user_lines_on_neuron():
    with record_ops() as rec:
        t = torch.ones(3, device="neuron"); line = sys._getframe().f_lineno  # noqa: E702
        (t * 2.5).sum()
    assert rec.names() == ["aten.ones.default", "aten.mul.Tensor", "aten.sum.default"]
    ones = rec[0]
    assert ones.results[0][4] == torch.device("neuron:0")
    assert ones.source.endswith(f"test_record.py:{line} in test_recorder_sees_factories_and_user_lines_on_neuron")
    assert f"test_record.py:{line + 1}" in rec[2].source
    assert "2.5" in repr(rec[1])


class _ThreadNotingRecorder(OpRecorder):
    """Notes which thread issued each op."""

    def __init__(self):
        super().__init__()
        self.threads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.threads.append((str(func), threading.get_ident()))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_recorder_sees_ops_autograd_runs_on_its_backward_thread():
    model, _, x, y = _tiny_step("neuron")
    with _ThreadNotingRecorder() as rec:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
    issued_on = dict(rec.threads)
    assert "aten.threshold_backward.default" in rec.names()
    # Backward on a PrivateUse1 device runs on autograd's device thread, not ours.
    assert issued_on["aten.threshold_backward.default"] != threading.get_ident()
    assert issued_on["aten.addmm.default"] == threading.get_ident()


def test_backward_ops_have_no_user_line_on_the_device_thread():
    model, _, x, y = _tiny_step("neuron")
    with record_ops() as rec:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
    backward = rec[rec.names().index("aten.threshold_backward.default")]
    assert backward.source is None  # autograd's device thread has only C++ callers
    assert "test_record.py:" in rec[rec.names().index("aten.addmm.default")].source
    assert "(no Python caller: autograd engine)" in str(rec)


def test_device_filter_keeps_only_ops_touching_that_device():
    cpu = torch.randn(3)
    with record_ops(devices="neuron") as rec:
        cpu.neg()
        torch.ones(2, device="neuron").neg()
    assert rec.names() == ["aten.ones.default", "aten.neg.default"]
    assert rec[1].results[0][4].type == "neuron"


def test_recorder_does_not_keep_tensors_alive():
    import weakref

    x = torch.randn(4, device="neuron")
    with record_ops() as rec:
        y = x + 1
    ref = weakref.ref(y)
    del y
    assert ref() is None
    assert all(v is None or not isinstance(v, torch.Tensor) or v.dim() == 0 for r in rec for v in r.values)


def test_the_users_source_line_is_named_relative_to_the_working_directory_it_is_asked_in(tmp_path, monkeypatch):
    # _short_path keeps what it computed (relpath costs 6-12 us): the working directory is part
    # of what it is kept under, so a chdir between two asks names the file anew.
    from adaptive_eager.engine.record import user_source_line

    this_file = sys._getframe().f_code.co_filename
    monkeypatch.chdir(os.path.dirname(this_file))
    assert user_source_line().split(":")[0] == os.path.basename(this_file)
    monkeypatch.chdir(tmp_path)  # outside the file's tree: the whole path
    assert user_source_line().split(":")[0] == this_file
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()  # no working directory at all: the whole path, not an error
    assert user_source_line().split(":")[0] == this_file
